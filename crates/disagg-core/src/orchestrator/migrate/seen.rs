//! The endpoints a request's continuations may no longer go to, or only after others:
//! one list, answering for each endpoint whether it may be chosen, and in what order.

use crate::endpoint::EndpointId;

/// Why an endpoint is on a request's list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    /// A decode tried (the first leg's, or a continuation's, started or not): never
    /// chosen again.
    Tried,
    /// A decode whose stream ended for the fresh prefill riding in it, not for its own
    /// fault: chosen again, after the decodes never tried.
    Again,
    /// A fresh prefill whose leg was told [`LegOutcome::Failed`], its engine to blame
    /// (its leg or its handoff failed, riding in a continuation's stream or before its
    /// decode started, the plan's resolution included; not one that refused its leg or
    /// ran into the request's deadline): never chosen again, as passive health counts it.
    ///
    /// [`LegOutcome::Failed`]: crate::outcome::LegOutcome::Failed
    FailedPrefill,
}

impl Why {
    fn decode(self) -> bool {
        !matches!(self, Why::FailedPrefill)
    }
}

/// The endpoints a request's continuations went to, each at most once as a decode
/// ([`Why::Tried`] or [`Why::Again`], the last word kept) and once as a prefill (an
/// endpoint listed in both roles has a record for each).
#[derive(Debug, Clone, Default)]
pub(super) struct Seen(Vec<(EndpointId, Why)>);

impl Seen {
    /// The list of a request whose first leg went to the decode `first`.
    pub(super) fn first(first: &EndpointId) -> Self {
        let mut seen = Seen::default();
        seen.tried(first);
        seen
    }

    /// The decode `id` was tried: never chosen again.
    pub(super) fn tried(&mut self, id: &EndpointId) {
        self.decode(id, Why::Tried);
    }

    /// The stream on the decode `id` ended for its riding prefill: chosen again, after
    /// the decodes never tried.
    pub(super) fn again(&mut self, id: &EndpointId) {
        self.decode(id, Why::Again);
    }

    /// The fresh prefill `id` failed through its engine's fault: never chosen again.
    pub(super) fn failed_prefill(&mut self, id: &EndpointId) {
        if self.may_prefill(id) {
            self.0.push((id.clone(), Why::FailedPrefill));
        }
    }

    /// Whether the decode `id` may be chosen: `None` when it may not, else whether it
    /// goes after the decodes never tried (`Some(true)`).
    pub(super) fn decode_rank(&self, id: &EndpointId) -> Option<bool> {
        match self.0.iter().find(|(e, w)| e == id && w.decode()) {
            None => Some(false),
            Some((_, Why::Again)) => Some(true),
            Some(_) => None,
        }
    }

    /// Whether the prefill `id` may be chosen.
    pub(super) fn may_prefill(&self, id: &EndpointId) -> bool {
        !self
            .0
            .iter()
            .any(|(e, w)| e == id && *w == Why::FailedPrefill)
    }

    fn decode(&mut self, id: &EndpointId, why: Why) {
        match self.0.iter_mut().find(|(e, w)| e == id && w.decode()) {
            Some(record) => record.1 = why,
            None => self.0.push((id.clone(), why)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> EndpointId {
        EndpointId::from(s)
    }

    #[test]
    fn a_decode_is_listed_once_with_its_last_word() {
        let (d1, d2, d3) = (id("http://d1"), id("http://d2"), id("http://d3"));
        let mut seen = Seen::first(&d1);
        assert_eq!(seen.decode_rank(&d1), None, "tried");
        assert_eq!(seen.decode_rank(&d2), Some(false), "never tried: first");
        seen.tried(&d2);
        seen.again(&d2);
        assert_eq!(seen.decode_rank(&d2), Some(true), "again: after the others");
        seen.tried(&d2);
        assert_eq!(seen.decode_rank(&d2), None, "tried again");
        seen.again(&d2);
        seen.again(&d2);
        assert_eq!(seen.0.len(), 2, "{seen:?}");
        assert_eq!(seen.decode_rank(&d3), Some(false));
    }

    #[test]
    fn a_failed_prefill_is_listed_once_and_apart_from_a_decode_of_the_same_id() {
        let (p1, p2) = (id("http://p1"), id("http://p2"));
        let mut seen = Seen::default();
        seen.failed_prefill(&p1);
        seen.failed_prefill(&p1);
        assert_eq!(seen.0.len(), 1, "{seen:?}");
        assert!(!seen.may_prefill(&p1));
        assert!(seen.may_prefill(&p2));
        // An endpoint listed as a prefill and as a decode: each role's record stands.
        assert_eq!(seen.decode_rank(&p1), Some(false));
        seen.tried(&p1);
        assert_eq!(seen.decode_rank(&p1), None);
        assert!(!seen.may_prefill(&p1));
        seen.again(&p1);
        assert_eq!(seen.decode_rank(&p1), Some(true));
        assert!(!seen.may_prefill(&p1));
        seen.tried(&p2);
        assert!(seen.may_prefill(&p2), "a decode tried is no failed prefill");
    }
}
