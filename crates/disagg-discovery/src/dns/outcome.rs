//! What one DNS lookup of a name gives: its engines and addresses, or why not.

use std::net::IpAddr;
use std::time::Duration;

use hickory_resolver::net::NetError;
use hickory_resolver::proto::op::ResponseCode;
use hickory_resolver::proto::rr::Name;
use tokio::time::Instant;

use crate::spec::EndpointSpec;

/// A successful resolution: the engines, how long the answer is valid, and the fully
/// qualified name that answered (`None` for an address written as the name).
pub(super) struct Resolved {
    pub(super) specs: Vec<EndpointSpec>,
    pub(super) ttl: Duration,
    pub(super) answered: Option<Name>,
    /// A family whose lookup failed beside one that answered with records (`true`:
    /// IPv6), and why: the name keeps its last good engines of that family.
    pub(super) failed: Option<(bool, Failure)>,
}

/// Whether the engine URL `url` (`http://[v6]:port` or `http://v4:port`) names an
/// IPv6 address.
pub(super) fn is_v6(url: &str) -> bool {
    url.strip_prefix("http://")
        .is_some_and(|a| a.starts_with('['))
}

/// A name's addresses.
pub(super) struct Addresses {
    pub(super) ips: Vec<IpAddr>,
    /// Until when they hold (the shortest TTL, a negative one included).
    pub(super) until: Instant,
    /// A family whose lookup failed beside one that answered with records (`true`:
    /// IPv6): the answer lacks that family's addresses, which are not known to be gone.
    /// A DNS server that drops AAAA queries does not make an IPv4 name fail.
    pub(super) failed: Option<(bool, Failure)>,
}

#[derive(Debug)]
pub(super) enum Failure {
    /// An answer without records: NXDOMAIN, or no records of the type asked.
    NoRecords { negative_ttl: Option<u32> },
    /// No answer, or an answer that is no clean negative one (SERVFAIL, refused).
    Lookup(NetError),
    /// Answers that name more engines than the ceiling (found so far when it stopped).
    TooMany { found: usize, max: usize },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::NoRecords { .. } => f.write_str("no records"),
            Failure::Lookup(e) => e.fmt(f),
            Failure::TooMany { found, max } => write!(
                f,
                "the answers name {found} engines or more, past the ceiling per source \
                 (--max-endpoints-per-source {max})"
            ),
        }
    }
}

impl From<NetError> for Failure {
    /// A clean negative answer (NXDOMAIN, or no error and no records) is
    /// [`Failure::NoRecords`]; anything else is a failed lookup.
    fn from(e: NetError) -> Self {
        match &e {
            NetError::Dns(hickory_resolver::net::DnsError::NoRecordsFound(no))
                if matches!(
                    no.response_code,
                    ResponseCode::NXDomain | ResponseCode::NoError
                ) =>
            {
                Failure::NoRecords {
                    negative_ttl: no.negative_ttl,
                }
            }
            _ => Failure::Lookup(e),
        }
    }
}
