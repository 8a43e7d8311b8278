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
/// records, the name that gave it, and the first name passed over for its SERVFAIL
/// (with the failure), if any: an answer found past one is not to be pinned, and the
/// failure is counted.
pub(super) struct Walked<T> {
    pub(super) found: T,
    pub(super) name: Name,
    pub(super) passed_over: Option<(Name, Failure)>,
}

/// Asks `ask` about each of `names` in turn: the first to answer with records gives
/// the answer. One answering cleanly without records passes on to the next; so does a
/// SERVFAIL, as with glibc's resolver, remembered (a search domain whose upstream
/// server fails hides no name under the next one). Any other failure (a timeout, a
/// refusal) fails the lookup there: stricter than glibc's `res_search`, which goes on
/// to the search list past such a failure of the name asked as written first, and
/// past one in the search list still asks the name as written when it has not yet:
/// here no answer is taken past a name whose answer is unknown (it may be the one
/// meant). No name with records is the first SERVFAIL passed over when there was one
/// (the name that failed may be the one that has the records: a failed lookup, not a
/// name without engines), else [`Failure::NoRecords`] with the shortest negative TTL
/// given.
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
                    passed_over: server_failure,
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
                server_failure.get_or_insert((name, failed));
            }
            Err(failed) => return Err(failed),
        }
    }
    Err(server_failure.map_or(Failure::NoRecords { negative_ttl }, |(_, failed)| failed))
}
