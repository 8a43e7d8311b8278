//! P/D pair enforcement: refuse endpoint sets with a prefill/decode pair that cannot
//! hand KV over.
//!
//! The facts are `disagg-core`'s ([`disagg_core::pairing`]): what an endpoint declares
//! in its [`KvProfile`] (its engine's KV connector, `kv_role` and tensor-parallel size)
//! and [`check_pair`], which names the [`Mismatch`](disagg_core::pairing::Mismatch) of
//! one pair. This module applies them to whole sets: [`check_pairs`] checks every
//! prefill/decode pair of a set against the orchestrator's connector and refuses,
//! naming both endpoints and the mismatch of each refused pair; [`ValidatedSource`]
//! applies the check at start-up (a set with a bad pair is an error, so a proxy refuses
//! to start) and to every endpoint set its inner source publishes later: an endpoint
//! joining that cannot pair with those in force is left out (logged, kept in
//! [`ValidatedSource::last_error`]), and the rest of the change goes through.
//!
//! # Examples
//!
//! An orchestrator whose source is checked now and on every change:
//!
//! ```
//! use std::sync::Arc;
//! use disagg_core::VllmNixl;
//! use disagg_core::connector::KvConnector;
//! use disagg_core::endpoint::{Endpoint, Role};
//! use disagg_core::source::StaticSource;
//! use disagg_core::transport::Transport;
//! use disagg_core::Orchestrator;
//! use disagg_resilience::pairing::ValidatedSource;
//!
//! # fn build(transport: impl Transport) -> Result<(), Box<dyn std::error::Error>> {
//! let connector: Arc<dyn KvConnector> = Arc::new(VllmNixl::new());
//! let source = StaticSource::new([
//!     Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?,
//!     Endpoint::new("http://10.0.0.7:8200", Role::Decode)?,
//! ]);
//! // Refuses at once a set with a pair that cannot hand over (`PairingError`).
//! let source = ValidatedSource::new(source, Arc::clone(&connector))?;
//! let orchestrator = Orchestrator::builder(source, transport)
//!     .connector(connector)
//!     .build();
//! # let _ = orchestrator; Ok(()) }
//! ```

use std::fmt;
use std::sync::{Arc, Mutex};

use disagg_core::connector::KvConnector;
use disagg_core::endpoint::{Endpoint, EndpointSet, Role};
use disagg_core::outcome::Listener;
use disagg_core::pairing::{KvProfile, PairError, check_pair};
use disagg_core::source::EndpointSource;
use tokio::sync::watch;

use crate::lock;

/// Every pair of an endpoint set that cannot hand KV over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairingError {
    /// The refused pairs (at least one).
    pub pairs: Vec<PairError>,
}

impl fmt::Display for PairingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} prefill/decode pair(s) refused", self.pairs.len())?;
        for p in &self.pairs {
            write!(f, "; {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for PairingError {}

/// Check every prefill/decode pair of `set` against `connector`.
///
/// # Errors
///
/// [`PairingError`] listing every refused pair.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use disagg_core::VllmNixl;
/// use disagg_core::endpoint::{Endpoint, EndpointSet, Role};
/// use disagg_core::pairing::{KvProfile, KvRole};
/// use disagg_resilience::pairing::check_pairs;
///
/// let mut ext = http::Extensions::new();
/// ext.insert(KvProfile { role: Some(KvRole::Producer), ..Default::default() });
/// let decode_as_producer = Endpoint::with_extensions("http://d:1", Role::Decode, ext)?;
/// let set = EndpointSet::new([
///     Arc::new(Endpoint::new("http://p:1", Role::Prefill)?),
///     Arc::new(decode_as_producer),
/// ]);
/// let err = check_pairs(&set, &VllmNixl::new()).unwrap_err();
/// assert!(err.to_string().contains("http://p:1"));
/// assert!(err.to_string().contains("http://d:1"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn check_pairs(set: &EndpointSet, connector: &dyn KvConnector) -> Result<(), PairingError> {
    let none = KvProfile::default();
    let mut pairs = Vec::new();
    for p in set.prefill() {
        let pp = p.ext().get::<KvProfile>().unwrap_or(&none);
        for d in set.decode() {
            let dp = d.ext().get::<KvProfile>().unwrap_or(&none);
            if let Err(mismatch) = check_pair(pp, dp, connector) {
                pairs.push(PairError {
                    prefill: p.id().clone(),
                    decode: d.id().clone(),
                    mismatch,
                });
            }
        }
    }
    if pairs.is_empty() {
        Ok(())
    } else {
        Err(PairingError { pairs })
    }
}

struct Shared {
    tx: watch::Sender<Arc<EndpointSet>>,
    last_error: Mutex<Option<PairingError>>,
}

/// An [`EndpointSource`] that publishes only endpoint sets whose every prefill/decode
/// pair can hand KV over ([`check_pairs`]).
///
/// Built over another source: the current set is checked at once (an invalid one is an
/// error, so a proxy refuses to start), and, when built inside a Tokio runtime, every
/// set the inner source publishes later is checked before it is passed on. In a later
/// set, the endpoints already in force stay (they pair with each other); each
/// endpoint that joins is admitted only if it pairs with every endpoint of the other
/// role admitted so far, and is otherwise left out of the published set, with an error
/// log and the refused pairs in [`last_error`](Self::last_error). So one engine
/// discovered with the wrong KV profile never takes the fleet's other changes with it,
/// and never crashes the proxy; it joins as soon as a set without the conflict comes.
/// The watching task ends when this source is dropped.
pub struct ValidatedSource {
    shared: Arc<Shared>,
    task: Option<tokio::task::JoinHandle<()>>,
    /// The inner source's listener, passed on.
    listener: Option<Arc<dyn Listener>>,
}

impl fmt::Debug for ValidatedSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ValidatedSource")
            .field("watching", &self.task.is_some())
            .finish_non_exhaustive()
    }
}

impl ValidatedSource {
    /// Check `inner`'s current set and follow its changes.
    ///
    /// # Errors
    ///
    /// [`PairingError`] when the current set has a pair that cannot hand over.
    pub fn new(
        inner: impl EndpointSource,
        connector: Arc<dyn KvConnector>,
    ) -> Result<Self, PairingError> {
        let mut rx = inner.watch();
        let listener = inner.listener();
        let first = rx.borrow_and_update().clone();
        check_pairs(&first, &*connector)?;
        let (tx, _) = watch::channel(first);
        let shared = Arc::new(Shared {
            tx,
            last_error: Mutex::new(None),
        });
        let task = tokio::runtime::Handle::try_current().ok().map(|rt| {
            let shared = Arc::clone(&shared);
            rt.spawn(async move {
                // The inner source is kept alive while its sets are followed.
                let _inner = inner;
                while rx.changed().await.is_ok() {
                    let set = rx.borrow_and_update().clone();
                    let current = shared.tx.borrow().clone();
                    let (admitted, refused) = admit(&current, &set, &*connector);
                    match refused {
                        None => *lock(&shared.last_error) = None,
                        Some(e) => {
                            tracing::error!(error = %e, "endpoints left out of the set: they cannot hand KV over");
                            *lock(&shared.last_error) = Some(e);
                        }
                    }
                    shared.tx.send_replace(admitted);
                }
            })
        });
        Ok(ValidatedSource {
            shared,
            task,
            listener,
        })
    }

    /// The pairs that kept endpoints of the latest set the inner source published out of
    /// the published set, if any.
    pub fn last_error(&self) -> Option<PairingError> {
        lock(&self.shared.last_error).clone()
    }
}

/// The set to publish for `next`, the inner source's new set, when `current` is in force:
/// the endpoints of `next` already in force (by id) first, then each other endpoint of
/// `next`, in its order, if it pairs with every endpoint of the other role admitted so
/// far. Returns the set and the pairs that left endpoints out.
fn admit(
    current: &EndpointSet,
    next: &Arc<EndpointSet>,
    connector: &dyn KvConnector,
) -> (Arc<EndpointSet>, Option<PairingError>) {
    if check_pairs(next, connector).is_ok() {
        return (Arc::clone(next), None);
    }
    let in_force = |e: &Arc<Endpoint>| current.by_role(e.role()).iter().any(|c| c.id() == e.id());
    let all = || next.prefill().iter().chain(next.decode());
    let mut admitted: Vec<Arc<Endpoint>> = all().filter(|e| in_force(e)).cloned().collect();
    let none = KvProfile::default();
    let mut pairs = Vec::new();
    for e in all().filter(|e| !in_force(e)) {
        let profile = e.ext().get::<KvProfile>().unwrap_or(&none);
        let mut bad = Vec::new();
        for other in admitted.iter().filter(|o| o.role() != e.role()) {
            let theirs = other.ext().get::<KvProfile>().unwrap_or(&none);
            let (p, d, pp, dp) = match e.role() {
                Role::Prefill => (e, other, profile, theirs),
                Role::Decode => (other, e, theirs, profile),
            };
            if let Err(mismatch) = check_pair(pp, dp, connector) {
                bad.push(PairError {
                    prefill: p.id().clone(),
                    decode: d.id().clone(),
                    mismatch,
                });
            }
        }
        if bad.is_empty() {
            admitted.push(Arc::clone(e));
        } else {
            pairs.extend(bad);
        }
    }
    let refused = (!pairs.is_empty()).then_some(PairingError { pairs });
    (Arc::new(EndpointSet::new(admitted)), refused)
}

impl Drop for ValidatedSource {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl EndpointSource for ValidatedSource {
    fn watch(&self) -> watch::Receiver<Arc<EndpointSet>> {
        self.shared.tx.subscribe()
    }

    fn snapshot(&self) -> Arc<EndpointSet> {
        self.shared.tx.borrow().clone()
    }

    fn listener(&self) -> Option<Arc<dyn Listener>> {
        self.listener.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use disagg_core::endpoint::{Endpoint, Role};
    use disagg_core::pairing::KvRole;
    use disagg_core::{VllmMooncake, VllmNixl};

    fn ep(url: &str, role: Role, profile: KvProfile) -> Arc<Endpoint> {
        let mut ext = http::Extensions::new();
        ext.insert(profile);
        Arc::new(Endpoint::with_extensions(url, role, ext).unwrap())
    }

    fn profile(connector: Option<&str>, role: Option<KvRole>, tp: Option<u32>) -> KvProfile {
        KvProfile {
            connector: connector.map(str::to_owned),
            role,
            tp_size: tp,
        }
    }

    #[test]
    fn every_refused_pair_is_listed_with_both_endpoints() {
        let set = EndpointSet::new([
            ep("http://p1:1", Role::Prefill, profile(None, None, Some(2))),
            ep("http://p2:1", Role::Prefill, profile(None, None, Some(4))),
            ep("http://d1:1", Role::Decode, profile(None, None, Some(4))),
            ep("http://d2:1", Role::Decode, profile(None, None, Some(8))),
        ]);
        let err = check_pairs(&set, &VllmMooncake::new()).unwrap_err();
        let pairs: Vec<(&str, &str)> = err
            .pairs
            .iter()
            .map(|p| (p.prefill.as_str(), p.decode.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("http://p1:1", "http://d1:1"),
                ("http://p1:1", "http://d2:1"),
                ("http://p2:1", "http://d2:1"),
            ]
        );
        let text = err.to_string();
        assert!(text.contains("3 prefill/decode pair(s) refused"), "{text}");
        assert!(text.contains("from tensor-parallel size 4 to 8"), "{text}");
    }

    /// A source whose sets the test publishes.
    struct Dynamic(watch::Sender<Arc<EndpointSet>>);

    impl EndpointSource for Dynamic {
        fn watch(&self) -> watch::Receiver<Arc<EndpointSet>> {
            self.0.subscribe()
        }
    }

    #[tokio::test]
    async fn endpoints_that_cannot_pair_are_left_out_on_change_and_refused_at_start() {
        let good = Arc::new(EndpointSet::new([
            ep("http://p:1", Role::Prefill, KvProfile::default()),
            ep("http://d:1", Role::Decode, KvProfile::default()),
        ]));
        let (tx, _) = watch::channel(Arc::clone(&good));
        let tx2 = tx.clone();
        let src = ValidatedSource::new(Dynamic(tx), Arc::new(VllmNixl::new())).unwrap();
        assert_eq!(src.snapshot().decode().len(), 1);

        // A bad decode joins: refused, the good set stays.
        let bad = Arc::new(EndpointSet::new([
            ep("http://p:1", Role::Prefill, KvProfile::default()),
            ep("http://d:1", Role::Decode, KvProfile::default()),
            ep(
                "http://d:2",
                Role::Decode,
                profile(Some("MooncakeConnector"), None, None),
            ),
        ]));
        tx2.send_replace(Arc::clone(&bad));
        let mut waited = 0;
        while src.last_error().is_none() && waited < 200 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            waited += 1;
        }
        let err = src.last_error().expect("the bad decode is left out");
        assert_eq!(err.pairs[0].decode.as_str(), "http://d:2");
        assert_eq!(src.snapshot().decode().len(), 1);

        // With the bad decode still there, a good one joining is admitted: one bad
        // engine does not hold the fleet's other changes back.
        let more = Arc::new(EndpointSet::new([
            ep("http://p:1", Role::Prefill, KvProfile::default()),
            ep("http://d:1", Role::Decode, KvProfile::default()),
            ep(
                "http://d:2",
                Role::Decode,
                profile(Some("MooncakeConnector"), None, None),
            ),
            ep("http://d:4", Role::Decode, KvProfile::default()),
        ]));
        let mut rx = src.watch();
        rx.borrow_and_update();
        tx2.send_replace(more);
        tokio::time::timeout(std::time::Duration::from_secs(2), rx.changed())
            .await
            .unwrap()
            .unwrap();
        let ids: Vec<_> = src
            .snapshot()
            .decode()
            .iter()
            .map(|e| e.id().as_str().to_owned())
            .collect();
        assert_eq!(ids, ["http://d:1", "http://d:4"]);
        assert_eq!(src.last_error().unwrap().pairs.len(), 1);

        // A good set passes again.
        let better = Arc::new(EndpointSet::new([
            ep("http://p:1", Role::Prefill, KvProfile::default()),
            ep("http://d:3", Role::Decode, KvProfile::default()),
        ]));
        tx2.send_replace(better);
        let mut rx = src.watch();
        tokio::time::timeout(std::time::Duration::from_secs(2), rx.changed())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(src.snapshot().decode()[0].id().as_str(), "http://d:3");
        assert!(src.last_error().is_none());

        // At start, an invalid set is an error.
        let (tx, _) = watch::channel(bad);
        assert!(ValidatedSource::new(Dynamic(tx), Arc::new(VllmNixl::new())).is_err());
    }
}
