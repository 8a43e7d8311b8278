//! Helpers shared by the discovery tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use disagg_core::{EndpointSource, Role, endpoint::EndpointSet};

/// A directory of its own under the system's temporary directory, removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "disagg-discovery-{tag}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The ids of `set`'s endpoints of `role`, sorted.
pub(crate) fn ids(set: &EndpointSet, role: Role) -> Vec<String> {
    let mut ids: Vec<String> = set
        .by_role(role)
        .iter()
        .map(|e| e.id().as_str().to_owned())
        .collect();
    ids.sort();
    ids
}

/// Waits until `source`'s set satisfies `pred`, at most `limit`; the set, or a panic
/// naming `what` and showing the last set.
pub(crate) async fn wait_for(
    source: &impl EndpointSource,
    limit: Duration,
    what: &str,
    pred: impl Fn(&EndpointSet) -> bool,
) -> Arc<EndpointSet> {
    let mut rx = source.watch();
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let set = rx.borrow_and_update().clone();
        if pred(&set) {
            return set;
        }
        if tokio::time::timeout_at(deadline, rx.changed())
            .await
            .is_err()
        {
            panic!(
                "{what}: not within {limit:?}; last set: prefill {:?}, decode {:?}",
                ids(&set, Role::Prefill),
                ids(&set, Role::Decode)
            );
        }
    }
}

/// Waits until `check` holds, polling, at most `limit`.
pub(crate) async fn eventually(limit: Duration, what: &str, check: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether `e` serves `model`: it declares it, or declares no models (the core's rule).
pub(crate) fn serves(e: &disagg_core::Endpoint, model: &str) -> bool {
    e.models().is_none_or(|ms| ms.iter().any(|m| &**m == model))
}
