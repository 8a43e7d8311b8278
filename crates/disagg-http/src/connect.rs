//! Connecting to an engine by name with the address rule of
//! [`AddressPolicy`](disagg_core::endpoint::AddressPolicy) applied to what the name resolves to.
//!
//! An endpoint's URL is checked when the endpoint is made, but a hostname's addresses
//! are known only when a connection is made, and may change between two connections (a
//! DNS record rebound to `169.254.169.254`). [`HttpTransport`](crate::HttpTransport)
//! therefore resolves the name itself and leaves out every address the policy refuses
//! before it tries one; a name with nothing else fails to connect, saying why. Nothing
//! is ever sent to a refused address.

use std::future::Future;
use std::io;
use std::net::SocketAddr;

use disagg_core::endpoint::AddressPolicy;

/// Connects to the first address of `addrs` that `policy` allows and `connect` reaches,
/// in order; refused addresses are skipped without a connection attempt.
///
/// # Errors
///
/// The last connection error; or, when every address was refused,
/// [`io::ErrorKind::PermissionDenied`] naming the refused address; or
/// [`io::ErrorKind::NotFound`] when there was no address at all.
pub(crate) async fn connect_allowed<S, F, Fut>(
    host: &str,
    addrs: impl IntoIterator<Item = SocketAddr>,
    policy: AddressPolicy,
    mut connect: F,
) -> io::Result<S>
where
    F: FnMut(SocketAddr) -> Fut,
    Fut: Future<Output = io::Result<S>>,
{
    let mut last = None;
    let mut refused = None;
    for addr in addrs {
        if !policy.allows(addr.ip()) {
            refused = Some(addr.ip());
            continue;
        }
        match connect(addr).await {
            Ok(stream) => return Ok(stream),
            Err(e) => last = Some(e),
        }
    }
    Err(match (last, refused) {
        (Some(e), _) => e,
        (None, Some(ip)) => io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{host} resolves to {ip}, a link-local or cloud metadata address, not an engine's (refused unless link-local engines are allowed)"
            ),
        ),
        (None, None) => io::Error::new(
            io::ErrorKind::NotFound,
            format!("{host} resolves to no address"),
        ),
    })
}

/// Resolves `host:port` and connects as [`connect_allowed`] does.
pub(crate) async fn connect(
    host: &str,
    port: u16,
    policy: AddressPolicy,
) -> io::Result<tokio::net::TcpStream> {
    let addrs = tokio::net::lookup_host((host, port)).await?;
    connect_allowed(host, addrs, policy, tokio::net::TcpStream::connect).await
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Where a test connector was asked to connect.
    type Tried = Arc<Mutex<Vec<SocketAddr>>>;

    /// A connector that records where it was asked to connect and reaches only
    /// `reachable`: no test sends anything to a refused address.
    fn recorder(
        reachable: SocketAddr,
    ) -> (
        Tried,
        impl FnMut(SocketAddr) -> std::future::Ready<io::Result<SocketAddr>>,
    ) {
        let tried = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&tried);
        let connect = move |addr: SocketAddr| {
            log.lock().unwrap().push(addr);
            std::future::ready(if addr == reachable {
                Ok(addr)
            } else {
                Err(io::Error::from(io::ErrorKind::ConnectionRefused))
            })
        };
        (tried, connect)
    }

    fn addrs(list: &[&str]) -> Vec<SocketAddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[tokio::test]
    async fn refused_addresses_are_never_tried() {
        let engine: SocketAddr = "127.0.0.1:8200".parse().unwrap();
        let (tried, connect) = recorder(engine);
        let resolved = addrs(&[
            "169.254.169.254:8200",
            "[fd00:ec2::254]:8200",
            "[::ffff:169.254.169.254]:8200",
            "127.0.0.1:8200",
        ]);
        let got = connect_allowed(
            "engine.example",
            resolved,
            AddressPolicy::default(),
            connect,
        )
        .await
        .unwrap();
        assert_eq!(got, engine);
        assert_eq!(*tried.lock().unwrap(), [engine]);
    }

    #[tokio::test]
    async fn a_name_with_only_refused_addresses_fails_saying_why() {
        let (tried, connect) = recorder("127.0.0.1:1".parse().unwrap());
        let resolved = addrs(&["169.254.169.254:80", "[fe80::1]:80"]);
        let err = connect_allowed(
            "metadata.internal",
            resolved,
            AddressPolicy::default(),
            connect,
        )
        .await
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        let text = err.to_string();
        assert!(
            text.contains("metadata.internal") && text.contains("link-local"),
            "{text}"
        );
        assert!(tried.lock().unwrap().is_empty());
        // Allowed explicitly, they are tried.
        let (tried, connect) = recorder("127.0.0.1:1".parse().unwrap());
        let resolved = addrs(&["169.254.169.254:80"]);
        let policy = AddressPolicy::allow_link_local();
        let err = connect_allowed("h", resolved, policy, connect)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
        assert_eq!(tried.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_loopback_engine_connects_by_name() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let stream = connect("127.0.0.1", port, AddressPolicy::default()).await;
        assert!(stream.is_ok(), "{stream:?}");
    }
}
