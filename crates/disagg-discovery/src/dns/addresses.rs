//! A fully qualified name's addresses: from `/etc/hosts`, or its A and AAAA records,
//! each family asked on its own.

use std::net::IpAddr;
use std::time::Duration;

use hickory_resolver::proto::op::Query;
use hickory_resolver::proto::rr::{Name, RecordType};
use tokio::time::Instant;

use super::Dns;
use super::outcome::{Addresses, Failure, sooner};

impl Dns {
    /// The addresses of the fully qualified `name`: from `/etc/hosts` when it knows the
    /// name, else its A and AAAA records, each family asked on its own. A family that
    /// fails (a timeout, SERVFAIL, a refusal) beside one with records is
    /// [`Addresses::failed`] (the caller keeps that family's last good addresses);
    /// beside one without records, or with the other failing too, it fails the lookup
    /// (both failing: by the failure that is not a SERVFAIL, if either).
    /// Only both families answering cleanly without records (NXDOMAIN, or no records of
    /// the type) is a name without addresses, [`Failure::NoRecords`].
    pub(super) async fn addresses(&self, name: &Name) -> Result<Addresses, Failure> {
        let listed = [RecordType::A, RecordType::AAAA].map(|kind| {
            self.hosts
                .lookup_static_host(&Query::query(name.clone(), kind))
        });
        if listed.iter().any(Option::is_some) {
            let mut ips = Vec::new();
            let mut until: Option<Instant> = None;
            for lookup in listed.iter().flatten() {
                ips.extend(lookup.answers().iter().filter_map(|r| r.data.ip_addr()));
                let valid = Instant::from_std(lookup.valid_until());
                until = Some(until.map_or(valid, |u| u.min(valid)));
            }
            return Ok(Addresses {
                ips,
                until: until.unwrap_or_else(Instant::now),
                failed: None,
            });
        }
        let (a, aaaa) = futures::join!(
            self.family(name, RecordType::A),
            self.family(name, RecordType::AAAA)
        );
        let mut ips = Vec::new();
        let mut until: Option<Instant> = None;
        let mut negative_ttl = None;
        let mut failed: Option<(bool, Failure)> = None;
        for (v6, outcome) in [(false, a), (true, aaaa)] {
            match outcome {
                Ok((found, valid)) => {
                    ips.extend(found);
                    until = Some(until.map_or(valid, |u| u.min(valid)));
                }
                Err(Failure::NoRecords { negative_ttl: ttl }) => {
                    negative_ttl = sooner(negative_ttl, ttl);
                }
                Err(e) => match failed.take() {
                    // Both families failed: the failure that is not a SERVFAIL when one
                    // is not (a timeout beside a SERVFAIL ends a search walk, as a
                    // timeout does, where a SERVFAIL would move it on).
                    Some((_, first)) if !first.is_server_failure() => return Err(first),
                    Some(_) => return Err(e),
                    None => failed = Some((v6, e)),
                },
            }
        }
        match (until, failed) {
            // A family without records may have some by its negative TTL.
            (Some(until), failed) => Ok(Addresses {
                ips,
                until: negative_ttl.map_or(until, |t| {
                    until.min(Instant::now() + Duration::from_secs(t.into()))
                }),
                failed,
            }),
            // No records where it answered, and a failure where it did not: not known
            // to be without engines.
            (None, Some((_, e))) => Err(e),
            (None, None) => Err(Failure::NoRecords { negative_ttl }),
        }
    }

    /// One family's addresses of the fully qualified `name`: an answer with none is
    /// [`Failure::NoRecords`].
    async fn family(
        &self,
        name: &Name,
        kind: RecordType,
    ) -> Result<(Vec<IpAddr>, Instant), Failure> {
        let lookup = self.resolver.lookup(name.clone(), kind).await?;
        let ips: Vec<IpAddr> = lookup
            .answers()
            .iter()
            .filter(|r| r.record_type() == kind)
            .filter_map(|r| r.data.ip_addr())
            .collect();
        if ips.is_empty() {
            return Err(Failure::NoRecords { negative_ttl: None });
        }
        Ok((ips, Instant::from_std(lookup.valid_until())))
    }
}
