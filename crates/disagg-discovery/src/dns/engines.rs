//! A name's engines, made from its answers as they come, and the addresses remembered
//! of each origin for a family of it that fails at a later lookup.

use std::collections::HashSet;
use std::net::IpAddr;
use std::time::Duration;

use hickory_resolver::proto::rr::Name;
use tokio::time::Instant;

use super::outcome::{
    Addresses, Failure, FamilyFailure, Kept, Origin, Origins, Remembered, Resolved,
};
use super::{DnsTarget, spec};
use crate::spec::EndpointSpec;

/// A name's engines, made as its answers come: each address once per port (an
/// IPv4-mapped IPv6 address as the IPv4 address it is, so that an address both
/// families answer is one engine), at most `max` of them.
///
/// The addresses each origin gave are remembered (for a family of it that fails at the
/// next lookup) once each, and at most `max` of them in all: an origin whose addresses
/// would take the name's total past `max` is not remembered, and a family of it that
/// fails at the next lookup keeps none. Origins sharing addresses (SRV targets
/// answering the same ones) are few engines but many addresses remembered, once per
/// origin: 256 targets answering the same 4,096 addresses would be a million.
/// Forgotten rather than refused ([`Failure::TooMany`]): the answer itself is within
/// the ceiling, and what such an answer loses is only the fallback for a failure to
/// come.
pub(super) struct Engines<'a> {
    target: &'a DnsTarget,
    last: &'a Origins,
    max: usize,
    /// How long after their last good answer a failed family's addresses are kept.
    max_stale: Duration,
    specs: Vec<EndpointSpec>,
    seen: HashSet<(IpAddr, u16)>,
    failed: Option<FamilyFailure>,
    origins: Origins,
    /// The addresses remembered in `origins`, all origins together.
    remembered: usize,
    /// The origins not remembered, for being past `max`.
    forgotten: usize,
    /// The engines there only as a failed family's last good addresses.
    kept: Kept,
    /// The failed families' addresses left out for being past `max_stale`.
    stale: Vec<Remembered>,
}

impl<'a> Engines<'a> {
    pub(super) fn new(
        target: &'a DnsTarget,
        last: &'a Origins,
        max: usize,
        max_stale: Duration,
    ) -> Self {
        Engines {
            target,
            last,
            max,
            max_stale,
            specs: Vec::new(),
            seen: HashSet::new(),
            failed: None,
            origins: Origins::new(),
            remembered: 0,
            forgotten: 0,
            kept: Kept::new(),
            stale: Vec::new(),
        }
    }

    /// Adds the engines of `origin`'s addresses `found` (at its port, weighing
    /// `weight`) and, when a family failed beside them, that family's addresses from
    /// `origin`'s last good answer, those that answered within `max_stale` (the others
    /// are left out, [`Resolved::stale`]). More engines than `max` is
    /// [`Failure::TooMany`].
    pub(super) fn add(
        &mut self,
        origin: Origin,
        found: Addresses,
        weight: Option<f64>,
    ) -> Result<(), Failure> {
        let now = Instant::now();
        let mut ips: Vec<(IpAddr, Instant)> = found.ips.into_iter().map(|ip| (ip, now)).collect();
        let failed_v6 = found.failed.as_ref().map(|(v6, _)| *v6);
        if let Some((v6, error)) = found.failed {
            // The family's last good addresses, those answered within `max_stale`.
            let kept = self.last.get(&origin).into_iter().flatten();
            let (fresh, stale): (Vec<(IpAddr, Instant)>, Vec<_>) = kept
                .copied()
                .filter(|(ip, _)| ip.is_ipv6() == v6)
                .partition(|(_, at)| at.checked_add(self.max_stale).is_none_or(|end| end > now));
            self.stale
                .extend(stale.into_iter().map(|(ip, at)| (origin.clone(), ip, at)));
            ips.extend(fresh);
            self.failed.get_or_insert(FamilyFailure {
                name: origin.0.clone(),
                v6,
                error,
            });
        }
        // Each address once, as its record had it (so its family is known).
        let mut distinct = HashSet::with_capacity(ips.len());
        ips.retain(|(ip, _)| distinct.insert(*ip));
        let port = origin.1;
        let mut new: Vec<IpAddr> = Vec::new();
        for &(ip, at) in &ips {
            let engine = (ip.to_canonical(), port);
            // Of the failed family (kept), or of the one that answered (fresh).
            let kept = failed_v6 == Some(ip.is_ipv6());
            if self.seen.insert(engine) {
                new.push(engine.0);
                if kept {
                    self.kept.insert(engine, at);
                }
            } else if !kept {
                // Answered now, by this origin, whatever another one kept of it.
                self.kept.remove(&engine);
            } else if let Some(since) = self.kept.get_mut(&engine) {
                *since = (*since).max(at);
            }
        }
        let found = self.specs.len() + new.len();
        if found > self.max {
            return Err(Failure::TooMany {
                found,
                max: self.max,
            });
        }
        self.specs.extend(new.into_iter().map(|ip| {
            let mut s = spec(self.target, ip, port);
            s.weight = weight;
            s
        }));
        match self.remembered.checked_add(ips.len()) {
            Some(total) if total <= self.max => {
                self.remembered = total;
                self.origins.insert(origin, ips);
            }
            _ => self.forgotten += 1,
        }
        Ok(())
    }

    /// The resolution: these engines, valid until `until`, found under `name`; pinned
    /// to it unless found past a SERVFAIL on an earlier name (`passed_over`).
    pub(super) fn resolved(
        self,
        until: Instant,
        name: Name,
        passed_over: Option<(Name, Failure)>,
    ) -> Resolved {
        if self.forgotten > 0 {
            tracing::debug!(
                name = %self.target.name,
                origins = self.forgotten,
                remembered = self.remembered,
                "addresses past the ceiling not remembered for a family that fails later"
            );
        }
        Resolved {
            specs: self.specs,
            ttl: until.saturating_duration_since(Instant::now()),
            pin: passed_over.is_none().then_some(name),
            passed_over,
            failed: self.failed,
            origins: self.origins,
            kept: self.kept,
            stale: self.stale,
        }
    }
}
