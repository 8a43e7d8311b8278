//! A name that is not fully qualified, completed as the system's resolver completes it:
//! the search list, `ndots`, and the walk through the names it may stand for.

use hickory_resolver::config::ResolverConfig;
use hickory_resolver::net::NetError;
use hickory_resolver::proto::rr::Name;

use super::Dns;
use super::outcome::{Failure, sooner};

/// The search list of `config`, as glibc's resolver has it: resolv.conf's last
/// `search` or `domain` line (each replaces the other: hickory's search list is that
/// line's domains), and only when it has neither, the system's domain (hickory's
/// `domain`: a `domain` line, else the host name's domain).
pub(super) fn search_list(config: &ResolverConfig) -> Vec<Name> {
    match (config.search(), config.domain()) {
        ([], Some(domain)) => vec![domain.clone()],
        (search, _) => search.to_vec(),
    }
}

impl Dns {
    /// The fully qualified names `name` may stand for, in the order the system's
    /// resolver asks them: `name` itself first when it has at least `ndots` dots (or is
    /// under `localhost`), then `name` under each search domain, then `name` itself when
    /// it has fewer dots. A name ending in `.` is only itself.
    pub(super) fn candidates(&self, name: &str) -> Result<Vec<Name>, Failure> {
        let name = Name::from_utf8(name).map_err(|e| Failure::Lookup(NetError::from(e)))?;
        if name.is_fqdn() {
            return Ok(vec![name]);
        }
        let mut itself = name.clone();
        itself.set_fqdn(true);
        let first = usize::from(name.num_labels()) > self.ndots || name.is_localhost();
        let mut names = Vec::with_capacity(self.search.len() + 1);
        if first {
            names.push(itself.clone());
        }
        for domain in self.search.iter() {
            if let Ok(under) = name.clone().append_domain(domain)
                && !names.contains(&under)
            {
                names.push(under);
            }
        }
        if !names.contains(&itself) {
            names.push(itself);
        }
        Ok(names)
    }
}

/// What a walk through the names a name may stand for found: the first answer with
/// records, the name that gave it, and whether that name may be pinned (no name before
/// it failed).
pub(super) struct Walked<T> {
    pub(super) found: T,
    pub(super) name: Name,
    pub(super) pin: bool,
}

/// Asks `ask` about each of `names` in turn, as glibc's resolver walks its search
/// list: the first to answer with records gives the answer. One answering cleanly
/// without records passes on to the next; so does a SERVFAIL, remembered (a search
/// domain whose upstream server fails hides no name under the next one); any other
/// failure (a timeout, a refusal) fails the lookup there. No name with records is the
/// first SERVFAIL passed over when there was one (the name that failed may be the one
/// that has the records: a failed lookup, not a name without engines), else
/// [`Failure::NoRecords`] with the shortest negative TTL given. An answer found past a
/// SERVFAIL is not to be pinned ([`Walked::pin`]).
pub(super) async fn first_answer<T, F, Fut>(
    names: Vec<Name>,
    mut ask: F,
) -> Result<Walked<T>, Failure>
where
    F: FnMut(Name) -> Fut,
    Fut: Future<Output = Result<T, Failure>>,
{
    let mut negative_ttl = None;
    let mut server_failure = None;
    for name in names {
        match ask(name.clone()).await {
            Ok(found) => {
                return Ok(Walked {
                    found,
                    name,
                    pin: server_failure.is_none(),
                });
            }
            Err(Failure::NoRecords { negative_ttl: ttl }) => {
                negative_ttl = sooner(negative_ttl, ttl);
            }
            Err(failed) if failed.is_server_failure() => {
                tracing::debug!(
                    name = %name,
                    error = %failed,
                    "DNS server failure on a search-list name; asking the next"
                );
                server_failure.get_or_insert(failed);
            }
            Err(failed) => return Err(failed),
        }
    }
    Err(server_failure.unwrap_or(Failure::NoRecords { negative_ttl }))
}
