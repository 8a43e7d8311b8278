//! ZMTP 3 on the wire: the greeting, frame headers and the commands of the NULL
//! mechanism, as pure functions over byte slices (no I/O, no allocation beyond what a
//! caller asks to encode).
//!
//! The layout follows the ZMTP 3.0 and 3.1 specifications (rfc.zeromq.org 23 and 37),
//! which libzmq (4.x) and the `zeromq` crate both speak:
//!
//! * **greeting** (64 bytes): `0xFF`, 8 padding bytes, `0x7F` (the signature), the
//!   version (major, minor), the mechanism name padded with zeros to 20 bytes, the
//!   as-server byte, 31 filler bytes;
//! * **frame**: a flags byte (bit 0 MORE, bit 1 LONG, bit 2 COMMAND, the others
//!   reserved and zero), the size as one byte, or as 8 big-endian bytes with LONG,
//!   then the body;
//! * **command body**: the name's length (one byte), the name, then the command's
//!   data; `READY`'s data is a list of properties, each a name (one length byte) and a
//!   value (four big-endian length bytes); `PING` carries a 16-bit TTL and up to 16
//!   bytes of context that `PONG` echoes.

/// The greeting's length.
pub const GREETING_LEN: usize = 64;

/// The longest frame header: the flags byte and an 8-byte size.
pub const MAX_HEADER_LEN: usize = 9;

/// The version this implementation advertises: 3.0, the one whose subscriptions are
/// data frames (`\x01topic`), which every 3.x peer accepts.
pub const VERSION: (u8, u8) = (3, 0);

const FLAG_MORE: u8 = 0b001;
const FLAG_LONG: u8 = 0b010;
const FLAG_COMMAND: u8 = 0b100;

/// Why bytes from a peer are not ZMTP 3 as this implementation speaks it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The greeting's signature bytes are wrong (not ZMTP, or ZMTP 1.0).
    #[error("not a ZMTP greeting")]
    Signature,
    /// A ZMTP version before 3.
    #[error("ZMTP {0}.{1} is not supported (3.x is)")]
    Version(u8, u8),
    /// A security mechanism other than NULL.
    #[error("security mechanism {0:?} is not supported (NULL is)")]
    Mechanism(String),
    /// Reserved flag bits set, or MORE on a command.
    #[error("frame flags {0:#04x} are invalid")]
    Flags(u8),
    /// A command that cannot be read (lengths beyond its body).
    #[error("malformed {0} command")]
    Command(&'static str),
    /// The handshake's first command is not READY, or READY names no socket type.
    #[error("the peer's handshake has no READY with a Socket-Type")]
    NoReady,
    /// The peer's socket type cannot talk to ours.
    #[error("a {ours} socket cannot talk to a {peer:?} peer")]
    SocketType {
        /// Our socket type.
        ours: &'static str,
        /// What the peer declared.
        peer: String,
    },
    /// The peer sent an ERROR command.
    #[error("the peer refused the connection: {0:?}")]
    PeerError(String),
}

/// Our greeting: version 3.0, the NULL mechanism.
pub fn greeting(as_server: bool) -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = VERSION.0;
    g[11] = VERSION.1;
    g[12..16].copy_from_slice(b"NULL");
    g[32] = u8::from(as_server);
    g
}

/// The peer's version, from its greeting.
///
/// # Errors
///
/// [`ProtocolError::Signature`], [`ProtocolError::Version`] (before 3.0) or
/// [`ProtocolError::Mechanism`] (not NULL).
pub fn parse_greeting(g: &[u8; GREETING_LEN]) -> Result<(u8, u8), ProtocolError> {
    if g[0] != 0xFF || g[9] != 0x7F {
        return Err(ProtocolError::Signature);
    }
    let version = (g[10], g[11]);
    if version.0 < 3 {
        return Err(ProtocolError::Version(version.0, version.1));
    }
    let mechanism = &g[12..32];
    let name_len = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
    if &mechanism[..name_len] != b"NULL" || mechanism[name_len..].iter().any(|&b| b != 0) {
        let name = String::from_utf8_lossy(&mechanism[..name_len]).into_owned();
        return Err(ProtocolError::Mechanism(name));
    }
    Ok(version)
}

/// A frame's header, read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// More frames of the same message follow.
    pub more: bool,
    /// A command, not message data.
    pub command: bool,
    /// The body's announced size, as sent (a peer may announce anything).
    pub len: u64,
}

/// How many header bytes follow the flags byte `flags`: 1 or 8.
///
/// # Errors
///
/// [`ProtocolError::Flags`] for reserved bits, or MORE on a command.
pub fn size_len(flags: u8) -> Result<usize, ProtocolError> {
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0
        || (flags & FLAG_COMMAND != 0 && flags & FLAG_MORE != 0)
    {
        return Err(ProtocolError::Flags(flags));
    }
    Ok(if flags & FLAG_LONG != 0 { 8 } else { 1 })
}

/// Reads a frame header from the front of `buf`: `Ok(None)` when `buf` holds less than
/// the whole header, else the header and its length in bytes.
///
/// # Errors
///
/// As [`size_len`].
pub fn parse_header(buf: &[u8]) -> Result<Option<(Header, usize)>, ProtocolError> {
    let Some(&flags) = buf.first() else {
        return Ok(None);
    };
    let n = size_len(flags)?;
    let Some(size) = buf.get(1..1 + n) else {
        return Ok(None);
    };
    let len = size.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
    Ok(Some((
        Header {
            more: flags & FLAG_MORE != 0,
            command: flags & FLAG_COMMAND != 0,
            len,
        },
        1 + n,
    )))
}

/// The header of a frame of `len` bytes (short form when it fits one byte).
pub fn encode_header(more: bool, command: bool, len: usize, out: &mut Vec<u8>) {
    let mut flags = 0;
    if more {
        flags |= FLAG_MORE;
    }
    if command {
        flags |= FLAG_COMMAND;
    }
    match u8::try_from(len) {
        Ok(short) => out.extend_from_slice(&[flags, short]),
        Err(_) => {
            out.push(flags | FLAG_LONG);
            out.extend_from_slice(&(len as u64).to_be_bytes());
        }
    }
}

/// A command from a peer, borrowed from its frame's body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command<'a> {
    /// READY and its `Socket-Type` property (`None` when absent).
    Ready {
        /// The peer's socket type, e.g. `b"PUB"`.
        socket_type: Option<&'a [u8]>,
    },
    /// PING: answer PONG with the same context.
    Ping {
        /// Up to 16 bytes to echo.
        context: &'a [u8],
    },
    /// ERROR and its reason.
    Error {
        /// The reason, as sent.
        reason: &'a [u8],
    },
    /// Any other command (PONG, SUBSCRIBE, CANCEL, ...): nothing to do for a receiver.
    Other(&'a [u8]),
}

/// Reads a command frame's body.
///
/// # Errors
///
/// [`ProtocolError::Command`] when a length runs past the body.
pub fn parse_command(body: &[u8]) -> Result<Command<'_>, ProtocolError> {
    let (&name_len, rest) = body.split_first().ok_or(ProtocolError::Command("empty"))?;
    let name_len = usize::from(name_len);
    if rest.len() < name_len {
        return Err(ProtocolError::Command("truncated"));
    }
    let (name, data) = rest.split_at(name_len);
    Ok(match name {
        b"READY" => Command::Ready {
            socket_type: ready_socket_type(data)?,
        },
        b"PING" => {
            // A 16-bit TTL, then the context (at most 16 bytes).
            let context = data.get(2..).ok_or(ProtocolError::Command("PING"))?;
            if context.len() > 16 {
                return Err(ProtocolError::Command("PING"));
            }
            Command::Ping { context }
        }
        b"ERROR" => {
            let (&len, reason) = data.split_first().unwrap_or((&0, &[]));
            Command::Error {
                reason: reason.get(..usize::from(len)).unwrap_or(reason),
            }
        }
        other => Command::Other(other),
    })
}

/// The `Socket-Type` of READY's properties.
fn ready_socket_type(mut data: &[u8]) -> Result<Option<&[u8]>, ProtocolError> {
    let bad = ProtocolError::Command("READY");
    let mut socket_type = None;
    while let Some((&name_len, rest)) = data.split_first() {
        let (name, rest) = rest
            .split_at_checked(usize::from(name_len))
            .ok_or(bad.clone())?;
        let (value_len, rest) = rest.split_first_chunk::<4>().ok_or(bad.clone())?;
        // A length past the body is refused without adding to it: on a 32-bit target
        // `u32::MAX` bytes do not fit a `usize` offset.
        let value_len = usize::try_from(u32::from_be_bytes(*value_len)).map_err(|_| bad.clone())?;
        let (value, rest) = rest.split_at_checked(value_len).ok_or(bad.clone())?;
        // Property names are case-insensitive.
        if name.eq_ignore_ascii_case(b"Socket-Type") && socket_type.is_none() {
            socket_type = Some(value);
        }
        data = rest;
    }
    Ok(socket_type)
}

/// A whole READY command frame (header included) declaring `socket_type`.
pub fn encode_ready(socket_type: &str) -> Vec<u8> {
    let mut body = Vec::with_capacity(32);
    body.push(5);
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    let mut out = Vec::with_capacity(body.len() + MAX_HEADER_LEN);
    encode_header(false, true, body.len(), &mut out);
    out.extend_from_slice(&body);
    out
}

/// A whole PONG command frame echoing `context`.
pub fn encode_pong(context: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + 5 + context.len());
    encode_header(false, true, 5 + context.len(), &mut out);
    out.push(4);
    out.extend_from_slice(b"PONG");
    out.extend_from_slice(context);
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn greetings_round_trip_and_refuse_others() {
        assert_eq!(parse_greeting(&greeting(false)), Ok((3, 0)));
        let mut g = greeting(true);
        g[11] = 1;
        assert_eq!(parse_greeting(&g), Ok((3, 1)));
        g[10] = 2;
        assert_eq!(parse_greeting(&g), Err(ProtocolError::Version(2, 1)));
        let mut g = greeting(false);
        g[12..17].copy_from_slice(b"CURVE");
        assert_eq!(
            parse_greeting(&g),
            Err(ProtocolError::Mechanism("CURVE".into()))
        );
        let mut g = greeting(false);
        g[9] = 0;
        assert_eq!(parse_greeting(&g), Err(ProtocolError::Signature));
    }

    #[test]
    fn headers_short_long_and_bad_flags() {
        assert_eq!(parse_header(&[]), Ok(None));
        assert_eq!(
            parse_header(&[0x01, 7]),
            Ok(Some((
                Header {
                    more: true,
                    command: false,
                    len: 7
                },
                2
            )))
        );
        // A long frame announcing 1 TiB is read as announced: the caller refuses it.
        let mut long = vec![0x02];
        long.extend_from_slice(&(1u64 << 40).to_be_bytes());
        assert_eq!(parse_header(&long[..5]), Ok(None));
        assert_eq!(parse_header(&long).unwrap().unwrap().0.len, 1 << 40);
        assert_eq!(parse_header(&[0x08, 0]), Err(ProtocolError::Flags(0x08)));
        assert_eq!(parse_header(&[0x05, 0]), Err(ProtocolError::Flags(0x05)));
    }

    #[test]
    fn commands() {
        let ready = encode_ready("PUB");
        let (h, n) = parse_header(&ready).unwrap().unwrap();
        assert!(h.command && !h.more);
        assert_eq!(
            parse_command(&ready[n..]),
            Ok(Command::Ready {
                socket_type: Some(&b"PUB"[..])
            })
        );
        let ping = b"\x04PING\x00\x10ctx";
        assert_eq!(parse_command(ping), Ok(Command::Ping { context: b"ctx" }));
        let pong = encode_pong(b"ctx");
        assert_eq!(parse_command(&pong[2..]), Ok(Command::Other(b"PONG")));
        assert_eq!(
            parse_command(b"\x05ERROR\x03bad"),
            Ok(Command::Error { reason: b"bad" })
        );
        assert!(parse_command(b"").is_err());
        assert!(parse_command(b"\x09READY").is_err());
        // A property whose value runs past the body.
        assert!(parse_command(b"\x05READY\x01x\x00\x00\x00\xff").is_err());
    }

    /// A READY property announcing a value of `u32::MAX` bytes: refused as a malformed
    /// command. `4 + value_len` overflowed `usize` on 32-bit targets (a panic in debug
    /// builds); the end of the value is now computed with checked arithmetic.
    #[test]
    fn a_property_of_u32_max_bytes_is_refused() {
        let mut body = b"\x05READY\x0bSocket-Type".to_vec();
        body.extend_from_slice(&u32::MAX.to_be_bytes());
        body.extend_from_slice(b"PUB");
        assert_eq!(parse_command(&body), Err(ProtocolError::Command("READY")));
        // The same property announcing its real length is read.
        let mut body = b"\x05READY\x0bSocket-Type".to_vec();
        body.extend_from_slice(&3u32.to_be_bytes());
        body.extend_from_slice(b"PUB");
        assert_eq!(
            parse_command(&body),
            Ok(Command::Ready {
                socket_type: Some(&b"PUB"[..])
            })
        );
    }

    proptest! {
        #[test]
        fn header_parse_never_panics_and_round_trips(bytes in proptest::collection::vec(any::<u8>(), 0..16)) {
            if let Ok(Some((h, n))) = parse_header(&bytes) {
                prop_assert!(n == 2 || n == 9);
                prop_assert!(n <= bytes.len());
                if let Ok(len) = usize::try_from(h.len) {
                    let mut out = Vec::new();
                    encode_header(h.more, h.command, len, &mut out);
                    let (again, _) = parse_header(&out).unwrap().unwrap();
                    prop_assert_eq!(again, h);
                }
            }
        }

        #[test]
        fn command_parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = parse_command(&bytes);
        }

        #[test]
        fn ready_round_trips(name in "[A-Z]{1,10}") {
            let frame = encode_ready(&name);
            let (_, n) = parse_header(&frame).unwrap().unwrap();
            prop_assert_eq!(
                parse_command(&frame[n..]).unwrap(),
                Command::Ready { socket_type: Some(name.as_bytes()) }
            );
        }

        #[test]
        fn greeting_parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 64)) {
            let mut g = [0u8; GREETING_LEN];
            g.copy_from_slice(&bytes);
            let _ = parse_greeting(&g);
        }
    }
}
