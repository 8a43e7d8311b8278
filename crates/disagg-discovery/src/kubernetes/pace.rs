//! Watches the API server ends at once, paced.
//!
//! kube-rs's watcher takes a watch stream that ends cleanly for one ended by its
//! `timeoutSeconds` and opens the next at once: no error reaches its backoff. An API
//! server, or a gateway in front of it, that closes every watch as soon as it is opened
//! would make a tight loop of watch requests. [`paced`] wraps one selector's client and
//! times each watch from its request to the clean end of its response: a watch that
//! ends within [`SHORT`] (or half its `timeoutSeconds`, if that is less) right after
//! another did makes the next watch request fail without being sent ([`ShortWatch`]).
//! That is an error as any other: the source logs and counts it, and kube-rs's backoff
//! waits before the next (0.8 s, doubling to 30 s, started over by an event or after 2
//! minutes without an error). A watch that lived longer, or a list between them, starts
//! the count over, so that one watch ended at once (a server restarting, a load balancer
//! failing over) is reopened at once, as before.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;
use tower::{BoxError, Service};

/// A watch the server ends within this long of its request is short.
pub(super) const SHORT: Duration = Duration::from_secs(5);

/// A watch request refused unsent: the watches before it ended at once.
#[derive(Debug, thiserror::Error)]
#[error(
    "the API server ended the last {watches} watches within {within:?} of their start (a gateway closing watches at once?); backing off before the next"
)]
pub(super) struct ShortWatch {
    /// Short watches in a row.
    watches: u32,
    /// What was short.
    within: Duration,
}

/// `client`, its watches paced (see the module's documentation); one per selector.
///
/// # Panics
///
/// When called outside a tokio runtime.
pub(super) fn paced(client: kube::Client) -> kube::Client {
    let namespace = client.default_namespace().to_owned();
    let paced = Paced {
        client,
        pace: Arc::default(),
    };
    kube::Client::new(paced, namespace)
}

/// The short watches of one selector.
#[derive(Debug, Default)]
struct Pace {
    /// Short watches in a row, since a list or a longer watch.
    short: u32,
    /// Whether the next watch request fails unsent.
    owed: bool,
    /// What the last short watch was short of.
    within: Duration,
}

/// Locks `pace` (a panic while it was held left plain numbers).
fn lock(pace: &Mutex<Pace>) -> std::sync::MutexGuard<'_, Pace> {
    pace.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The service [`paced`] makes of a client.
#[derive(Clone)]
struct Paced {
    client: kube::Client,
    pace: Arc<Mutex<Pace>>,
}

impl Service<Request<kube::client::Body>> for Paced {
    type Response = Response<Timed>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<kube::client::Body>) -> Self::Future {
        let short = watch_short(request.uri());
        {
            let mut pace = lock(&self.pace);
            match short {
                None => *pace = Pace::default(),
                Some(_) if pace.owed => {
                    pace.owed = false;
                    let error: BoxError = Box::new(ShortWatch {
                        watches: pace.short,
                        within: pace.within,
                    });
                    return Box::pin(async move { Err(error) });
                }
                Some(_) => {}
            }
        }
        let client = self.client.clone();
        let pace = Arc::clone(&self.pace);
        Box::pin(async move {
            let started = Instant::now();
            // Kept as kube-rs's error: its client passes a `kube::Error` on unchanged.
            let response = client.send(request).await.map_err(Box::new)?;
            Ok(response.map(|inner| Timed {
                inner,
                watch: short.map(|short| Watch {
                    started,
                    short,
                    pace,
                }),
            }))
        })
    }
}

/// How short a watch request's watch is when it ends: [`SHORT`], or half its
/// `timeoutSeconds` if that is less; `None` when `uri` asks for no watch.
fn watch_short(uri: &Uri) -> Option<Duration> {
    if !super::bounds::is_watch(uri) {
        return None;
    }
    let timeout = uri
        .query()
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|kv| kv.strip_prefix("timeoutSeconds="))
        .and_then(|t| t.parse::<u64>().ok())
        .filter(|t| *t > 0)
        .map(|t| Duration::from_secs(t) / 2);
    Some(timeout.map_or(SHORT, |t| t.min(SHORT)))
}

/// A watch being timed.
struct Watch {
    started: Instant,
    short: Duration,
    pace: Arc<Mutex<Pace>>,
}

/// A response body; a watch's timed to its clean end.
pub(super) struct Timed {
    inner: kube::client::Body,
    /// `None` for a list, and once the watch has ended.
    watch: Option<Watch>,
}

impl Body for Timed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &frame {
            // Ended by the server: timed.
            None => {
                if let Some(watch) = self.watch.take() {
                    let mut pace = lock(&watch.pace);
                    if watch.started.elapsed() < watch.short {
                        pace.short = pace.short.saturating_add(1);
                        pace.owed = pace.short >= 2;
                        pace.within = watch.short;
                    } else {
                        *pace = Pace::default();
                    }
                }
            }
            // Failed: an error already, backed off.
            Some(Err(_)) => self.watch = None,
            Some(Ok(_)) => {}
        }
        // kube-rs's own errors kept as they are, not wrapped twice.
        Poll::Ready(frame.map(|f| {
            f.map_err(|e| match e {
                kube::Error::Service(inner) => inner,
                other => Box::new(other),
            })
        }))
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_is_short_within_five_seconds_or_half_its_timeout() {
        let short = |uri: &str| watch_short(&uri.parse::<Uri>().unwrap());
        assert_eq!(short("/api/v1/namespaces/a/pods?limit=100"), None);
        assert_eq!(
            short("/api/v1/namespaces/a/pods?&watch=true&timeoutSeconds=290"),
            Some(SHORT)
        );
        assert_eq!(
            short("/api/v1/namespaces/a/pods?watch=true&timeoutSeconds=1"),
            Some(Duration::from_millis(500))
        );
        assert_eq!(
            short("/api/v1/namespaces/a/pods?watch=1&timeoutSeconds=0"),
            Some(SHORT)
        );
        assert_eq!(short("/api/v1/namespaces/a/pods?watch=true"), Some(SHORT));
    }
}
