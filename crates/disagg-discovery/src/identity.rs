//! How discovery reads an engine's address: the identity two spellings of one engine
//! share (compared by the merge and the endpoints file), the core's endpoint id of a
//! URL, and the form a KV-events endpoint must have.

use std::net::Ipv6Addr;

use crate::spec::SpecError;

/// `value` quoted for an error: whole when short, else its first 64 characters and its
/// length (a value from outside may be megabytes long).
fn quoted(value: &str) -> String {
    const SHOWN: usize = 64;
    match value.char_indices().nth(SHOWN) {
        None => format!("`{value}`"),
        Some((end, _)) => format!("`{}...` ({} bytes)", &value[..end], value.len()),
    }
}

/// Checks a KV-events endpoint as the socket that connects to it will:
/// `tcp://HOST:PORT`, HOST a DNS name of at most 253 bytes, an IPv4 address or a
/// bracketed IPv6 address, PORT a decimal number from 1 to 65535
/// ([`disagg_zmtp::conn::tcp_address`], the one rule for this form).
pub(crate) fn check_kv_events(events: &str) -> Result<(), SpecError> {
    disagg_zmtp::conn::tcp_address(events)
        .map(drop)
        .map_err(|_| SpecError::KvEvents(quoted(events)))
}

/// `url` without a trailing `@RANK`, and the rank, as the core reads it: an `@` whose
/// tail is not digits is no rank (the URL check refuses it); `None` for digits past
/// `u32` (no endpoint either).
fn split_rank(url: &str) -> Option<(&str, Option<u32>)> {
    match url.rsplit_once('@') {
        Some((base, rank)) if !rank.is_empty() && rank.bytes().all(|b| b.is_ascii_digit()) => {
            Some((base, Some(rank.parse().ok()?)))
        }
        _ => Some((url, None)),
    }
}

/// The id the core gives the endpoint at `url` (`Endpoint::id`): the URL before its
/// rank without a trailing `/`, and the rank reprinted; `url` as given when its rank
/// does not fit (it makes no endpoint).
pub(crate) fn core_id(url: &str) -> String {
    match split_rank(url) {
        Some((base, Some(rank))) => format!("{}@{rank}", base.trim_end_matches('/')),
        Some((base, None)) => base.trim_end_matches('/').to_owned(),
        None => url.to_owned(),
    }
}

/// Which engine (and rank) the endpoint at `url` (`URL` or `URL@RANK`, as the core
/// reads it) stands for, however its URL is spelled: `SCHEME://HOST:PORT[@RANK]` with
/// the scheme and the host in lowercase, an IPv6 address in its canonical text, the
/// port as a number (the scheme's default when none is written) and the rank as a
/// number. `http://D:08200/@03` and `http://d:8200@3` are one engine's rank 3. `None`
/// for a URL that makes no endpoint.
pub(crate) fn endpoint_identity(url: &str) -> Option<String> {
    let (base, rank) = split_rank(url)?;
    let uri: http::Uri = base.trim_end_matches('/').parse().ok()?;
    if uri
        .path_and_query()
        .is_some_and(|p| !p.as_str().is_empty() && p.as_str() != "/")
    {
        return None;
    }
    let scheme = uri.scheme_str()?.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "http" => 80,
        "https" => 443,
        _ => return None,
    };
    let authority = uri.authority()?;
    let host = authority.host();
    let host = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => format!("[{}]", v6.parse::<Ipv6Addr>().ok()?),
        None => host.to_ascii_lowercase(),
    };
    // What follows the host: nothing, or `:PORT` (no user information: no endpoint).
    let port = match authority.as_str().get(authority.host().len()..)? {
        "" | ":" => default_port,
        tail => tail.strip_prefix(':')?.parse::<u16>().ok()?,
    };
    Some(match rank {
        Some(rank) => format!("{scheme}://{host}:{port}@{rank}"),
        None => format!("{scheme}://{host}:{port}"),
    })
}

/// [`endpoint_identity`], or `id` itself for one that has none (never two endpoints
/// of one set: the core made it).
pub(crate) fn identity_or_id(id: &str) -> String {
    endpoint_identity(id).unwrap_or_else(|| id.to_owned())
}
