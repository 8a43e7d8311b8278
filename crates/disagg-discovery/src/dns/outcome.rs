//! What one DNS lookup of a name gives: its engines and addresses, or why not.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use hickory_resolver::net::{DnsError, NetError};
use hickory_resolver::proto::op::ResponseCode;
use hickory_resolver::proto::rr::Name;
use tokio::time::Instant;

use crate::spec::EndpointSpec;

/// A successful resolution: the engines, how long the answer is valid, and the fully
/// qualified name to ask from now on.
pub(super) struct Resolved {
    pub(super) specs: Vec<EndpointSpec>,
    pub(super) ttl: Duration,
    /// The name that answered, when it may be pinned: `None` for an address written as
    /// the name, and for an answer found past a server failure on an earlier name of the
    /// search list (the name that failed may be the one meant: the list is walked again
    /// at the next refresh).
    pub(super) pin: Option<Name>,
    /// The first name of the search list passed over for its SERVFAIL, and the
    /// failure, when the answer was found past one.
    pub(super) passed_over: Option<(Name, Failure)>,
    /// The first address family that failed beside one that answered with records:
    /// that family's last good addresses are among `specs`.
    pub(super) failed: Option<FamilyFailure>,
    /// The addresses each origin gave (the failed families' kept ones included): what
    /// the next lookup keeps of a family that fails.
    pub(super) origins: Origins,
    /// The engines among `specs` only as a failed family's last good addresses, each
    /// with when its family last answered with it: dropped at their own limit.
    pub(super) kept: Kept,
    /// The failed families' last good addresses left out, past `max_stale` after their
    /// last good answer: logged and counted when the name still held them (not when
    /// its stale limit dropped them while the lookup was under way).
    pub(super) stale: Vec<Remembered>,
}

/// An address family that failed beside one that answered with records.
pub(super) struct FamilyFailure {
    /// The fully qualified name asked (the name itself, or an SRV target).
    pub(super) name: Name,
    /// Whether it is IPv6 (AAAA) that failed.
    pub(super) v6: bool,
    pub(super) error: Failure,
}

/// Where some of a name's engines come from: the fully qualified name whose A/AAAA
/// records gave their addresses (the name itself, or an SRV target), and their port.
pub(super) type Origin = (Name, u16);

/// The addresses each origin gave in a name's last good answer, as their records had
/// them (so each one's family is known), each with when its family last answered with
/// it: a family whose lookup fails beside one that answers keeps its addresses from
/// here, for at most `max_stale` after that answer.
pub(super) type Origins = HashMap<Origin, Vec<(IpAddr, Instant)>>;

/// One address remembered of an origin, with when its family last answered with it.
pub(super) type Remembered = (Origin, IpAddr, Instant);

/// A name's engines (address, as its engine has it, and port) that are among its
/// engines only as the last good addresses of a family that failed, each with when its
/// family last answered with it (the latest, when several origins give it): each is
/// dropped `max_stale` after that, whatever the name's later lookups give (an answer
/// with the family refreshes it).
pub(super) type Kept = HashMap<(IpAddr, u16), Instant>;

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

impl Failure {
    /// Whether this is a server's SERVFAIL: a walk through the search list moves on to
    /// the next name past it (as glibc's resolver does), where any other failure (a
    /// timeout, a refusal) ends it ([`first_answer`](super::search::first_answer)).
    pub(super) fn is_server_failure(&self) -> bool {
        match self {
            Failure::Lookup(NetError::Dns(DnsError::ResponseCode(code))) => {
                *code == ResponseCode::ServFail
            }
            Failure::Lookup(NetError::Dns(DnsError::NoRecordsFound(no))) => {
                no.response_code == ResponseCode::ServFail
            }
            _ => false,
        }
    }
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
            NetError::Dns(DnsError::NoRecordsFound(no))
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

/// The shorter of two negative TTLs, either absent.
pub(super) fn sooner(a: Option<u32>, b: Option<u32>) -> Option<u32> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
