//! Active checks: `GET {path}` on each engine every `interval`.

use super::*;

// === active checks ===

/// One engine checked: every endpoint at one authority.
pub(super) struct Target {
    pub(super) authority: Authority,
    pub(super) uri: Uri,
    pub(super) states: Vec<Arc<EndpointState>>,
    pub(super) passes: u32,
    pub(super) failures: u32,
    pub(super) down: bool,
}

/// The checker's targets; on drop, lifts its Down verdicts.
pub(super) struct Checker {
    pub(super) health: Arc<Health>,
    pub(super) targets: Vec<Target>,
}

impl Checker {
    /// Group the registry's endpoints by authority, keeping the counters and verdicts of
    /// authorities still there; whether an endpoint's verdict changed.
    pub(super) fn retarget(&mut self) -> bool {
        let path = self.health.config.checks.path.as_str();
        let mut old = std::mem::take(&mut self.targets);
        let registry = read(&self.health.registry);
        let mut changed = false;
        for state in &registry.order {
            let authority = state.endpoint.authority();
            if let Some(t) = self.targets.iter_mut().find(|t| &t.authority == authority) {
                if t.down {
                    changed |= state.set_down(true, &"engine already down", t.failures);
                }
                t.states.push(Arc::clone(state));
                continue;
            }
            let uri = match state.endpoint.uri(path) {
                Ok(uri) => uri,
                Err(e) => {
                    // A `PathAndQuery` always makes a URI; kept for the type's sake.
                    tracing::error!(endpoint = %state.endpoint.id(), error = %e, "no health check URI");
                    continue;
                }
            };
            let mut target = match old.iter().position(|t| &t.authority == authority) {
                Some(i) => {
                    let mut t = old.swap_remove(i);
                    t.states.clear();
                    t
                }
                None => Target {
                    authority: authority.clone(),
                    uri,
                    states: Vec::new(),
                    passes: 0,
                    failures: 0,
                    down: false,
                },
            };
            if target.down {
                changed |= state.set_down(true, &"engine already down", target.failures);
            }
            target.states.push(Arc::clone(state));
            self.targets.push(target);
        }
        changed
    }

    /// Check every target once, concurrently; whether a verdict changed.
    pub(super) async fn round(&mut self, transport: &impl Transport) -> bool {
        let config = &self.health.config.checks;
        let probes = self
            .targets
            .iter()
            .map(|t| probe(transport, t.uri.clone(), config.timeout));
        let results = futures::future::join_all(probes).await;
        let mut changed = false;
        for (t, result) in self.targets.iter_mut().zip(results) {
            match result {
                Ok(()) => {
                    t.failures = 0;
                    t.passes = t.passes.saturating_add(1);
                    if t.down && t.passes >= config.healthy_threshold.max(1) {
                        t.down = false;
                        for s in &t.states {
                            changed |= s.set_down(false, &"health check passed", t.passes);
                        }
                    }
                }
                Err(failure) => {
                    t.passes = 0;
                    t.failures = t.failures.saturating_add(1);
                    if !t.down && t.failures >= config.unhealthy_threshold.max(1) {
                        t.down = true;
                        for s in &t.states {
                            changed |= s.set_down(true, &failure, t.failures);
                        }
                    } else {
                        tracing::debug!(authority = %t.authority, reason = %failure, "health check failed");
                    }
                }
            }
        }
        changed
    }
}

impl Drop for Checker {
    fn drop(&mut self) {
        let mut changed = false;
        for t in &self.targets {
            for s in &t.states {
                changed |= s.set_down(false, &"health checks stopped", 0);
            }
        }
        if changed {
            self.health.refresh();
        }
    }
}

/// Why a check failed.
pub(super) enum CheckFailure {
    Status(http::StatusCode),
    Timeout(Duration),
    Transport(TransportError),
}

impl fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckFailure::Status(s) => write!(f, "answered {s}"),
            CheckFailure::Timeout(t) => write!(f, "no answer within {t:?}"),
            CheckFailure::Transport(e) => f.write_str(&disagg_core::error::error_chain(e)),
        }
    }
}

/// One check: `GET uri`, a 2xx within `timeout` passes.
pub(super) fn probe(
    transport: &impl Transport,
    uri: Uri,
    timeout: Duration,
) -> impl Future<Output = Result<(), CheckFailure>> + Send + 'static {
    let mut req = http::Request::new(Bytes::new());
    *req.uri_mut() = uri;
    let sent = transport.send(req);
    let exchange = async move {
        let response = sent.await.map_err(CheckFailure::Transport)?;
        let status = response.status();
        // To the end, so the connection can serve the next check; its content is no
        // part of the verdict.
        let _ = read_limited(response.into_body(), MAX_CHECK_BODY).await;
        if status.is_success() {
            Ok(())
        } else {
            Err(CheckFailure::Status(status))
        }
    };
    async move {
        tokio::time::timeout(timeout, exchange)
            .await
            .unwrap_or(Err(CheckFailure::Timeout(timeout)))
    }
}
