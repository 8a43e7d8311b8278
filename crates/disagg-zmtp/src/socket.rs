//! The three receiving sockets disagg needs, over [`Connection`]:
//!
//! * [`Sub`]: connects to one `PUB` and subscribes to a topic (the engines' KV events
//!   and load reports);
//! * [`Dealer`]: connects to one `ROUTER` and exchanges messages (the engines' replay
//!   sockets);
//! * [`Pull`]: binds and takes messages from many `PUSH` peers (LMCache's KV-ready
//!   notifications), each peer under the limits on a task of its own: a peer over a
//!   limit is disconnected and counted, the others go on.
//!
//! None of them reconnects by itself: a failed connection is the caller's to renew
//! (with its own back-off), so every renewal is seen and counted where it is decided.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinHandle, JoinSet};

use crate::conn::{self, Connection, Error, Limits, Message, Reject, SocketType};

/// A `SUB` socket connected to one publisher.
#[derive(Debug)]
pub struct Sub {
    conn: Connection,
}

impl Sub {
    /// Connects to `endpoint` (`tcp://HOST:PORT`) and subscribes to `topic` (a prefix
    /// of the messages' first frame; empty for all), with `timeout` for the TCP
    /// connection.
    ///
    /// The subscription is sent as ZMTP 3.0's data frame `\x01topic`, which libzmq
    /// and the `zeromq` crate both accept.
    ///
    /// # Errors
    ///
    /// As [`conn::connect`].
    pub async fn connect(
        endpoint: &str,
        topic: &[u8],
        limits: Limits,
        timeout: Duration,
    ) -> Result<Sub, Error> {
        let mut conn = conn::connect(endpoint, SocketType::Sub, limits, timeout).await?;
        let mut subscribe = Vec::with_capacity(1 + topic.len());
        subscribe.push(1);
        subscribe.extend_from_slice(topic);
        conn.send(&[&subscribe]).await?;
        Ok(Sub { conn })
    }

    /// The next published message (see [`Connection::recv`]: not cancel-safe).
    ///
    /// # Errors
    ///
    /// As [`Connection::recv`].
    pub async fn recv(&mut self) -> Result<Message, Error> {
        self.conn.recv().await
    }
}

/// A `DEALER` socket connected to one peer.
#[derive(Debug)]
pub struct Dealer {
    conn: Connection,
}

impl Dealer {
    /// Connects to `endpoint` (`tcp://HOST:PORT`), with `timeout` for the TCP
    /// connection.
    ///
    /// # Errors
    ///
    /// As [`conn::connect`].
    pub async fn connect(
        endpoint: &str,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Dealer, Error> {
        let conn = conn::connect(endpoint, SocketType::Dealer, limits, timeout).await?;
        Ok(Dealer { conn })
    }

    /// Sends one message. To a `ROUTER` that answers a `REQ`-like exchange, lead with
    /// an empty delimiter frame.
    ///
    /// # Errors
    ///
    /// The socket's.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), Error> {
        self.conn.send(frames).await
    }

    /// The next message (see [`Connection::recv`]: not cancel-safe).
    ///
    /// # Errors
    ///
    /// As [`Connection::recv`].
    pub async fn recv(&mut self) -> Result<Message, Error> {
        self.conn.recv().await
    }
}

/// Settings of a [`Pull`] socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullConfig {
    /// Each peer's limits.
    pub limits: Limits,
    /// Peers connected at once; one more is closed at once and counted (default 1,024).
    pub max_peers: usize,
    /// Messages received but not yet taken by [`Pull::recv`]; when full, peers wait
    /// (TCP back-pressure) instead of being buffered (default 64).
    pub queue: usize,
    /// With [`max_peers`](Self::max_peers) connected, a newcomer takes the place of the
    /// peer idle longest (nothing received since its connection or its last message),
    /// if that one has been idle this long (default 60 s); otherwise the newcomer is
    /// closed. A peer that vanished without closing (a prefill pod's node lost, a
    /// NAT entry dropped) or that connects and sends nothing would otherwise hold its
    /// place for ever; a `PUSH` peer that is closed reconnects by itself.
    pub evict_idle_after: Duration,
    /// Peers connected at once from one host (default 256; 0 is taken as 1): one IPv4
    /// address, or one IPv6 /64, the block one machine is given and may draw
    /// addresses from at will. A newcomer from a host that has this many takes the
    /// place of that host's peer idle longest, if it has been idle past
    /// [`evict_idle_after`](Self::evict_idle_after); otherwise the newcomer is closed. One host (a busy or hostile process on the engines'
    /// network) then cannot hold every place of [`max_peers`](Self::max_peers) by
    /// connecting and sending, which keeps a peer from being idle.
    pub max_peers_per_host: usize,
}

impl PullConfig {
    /// With `limits` and the default peers and queue.
    pub fn new(limits: Limits) -> PullConfig {
        PullConfig {
            limits,
            max_peers: 1024,
            queue: 64,
            evict_idle_after: Duration::from_secs(60),
            max_peers_per_host: 256,
        }
    }
}

/// Counters of a [`Pull`] socket since it was bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PullStats {
    /// Peers connected now (handshake done or under way).
    pub peers: u64,
    /// Connections accepted.
    pub accepted: u64,
    /// Connections closed at once: [`PullConfig::max_peers`] were connected, none idle
    /// past [`PullConfig::evict_idle_after`].
    pub refused: u64,
    /// Connections closed at once: their host had
    /// [`PullConfig::max_peers_per_host`] connected, none idle past
    /// [`PullConfig::evict_idle_after`].
    pub refused_per_host: u64,
    /// Peers closed to make room for a newcomer, idle past
    /// [`PullConfig::evict_idle_after`].
    pub evicted: u64,
    /// Peers disconnected for a frame, message or frame count over the limits.
    pub oversized: u64,
    /// Peers disconnected for not speaking ZMTP 3 as a `PUSH` (greeting, mechanism,
    /// socket type, framing, commands).
    pub protocol: u64,
    /// Peers disconnected for not finishing the handshake in time.
    pub timeout: u64,
    /// Messages received.
    pub messages: u64,
}

#[derive(Debug, Default)]
struct Counters {
    peers: AtomicU64,
    accepted: AtomicU64,
    refused: AtomicU64,
    refused_per_host: AtomicU64,
    evicted: AtomicU64,
    oversized: AtomicU64,
    protocol: AtomicU64,
    timeout: AtomicU64,
    messages: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> PullStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PullStats {
            peers: get(&self.peers),
            accepted: get(&self.accepted),
            refused: get(&self.refused),
            refused_per_host: get(&self.refused_per_host),
            evicted: get(&self.evicted),
            oversized: get(&self.oversized),
            protocol: get(&self.protocol),
            timeout: get(&self.timeout),
            messages: get(&self.messages),
        }
    }

    fn rejected(&self, reject: Reject) {
        let counter = match reject {
            Reject::Oversized => &self.oversized,
            Reject::Protocol => &self.protocol,
            Reject::Timeout => &self.timeout,
            _ => return,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A `PULL` socket bound on a TCP listener, taking messages from many `PUSH` peers.
///
/// Dropping it closes the listener and every peer connection.
#[derive(Debug)]
pub struct Pull {
    messages: mpsc::Receiver<Message>,
    counters: Arc<Counters>,
    local_addr: SocketAddr,
    accept: JoinHandle<()>,
}

impl Drop for Pull {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Pull {
    /// Listens on `listener` (already bound): spawns the accept task on the current
    /// tokio runtime.
    ///
    /// # Errors
    ///
    /// When the listener has no local address.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn from_listener(listener: TcpListener, config: PullConfig) -> std::io::Result<Pull> {
        let local_addr = listener.local_addr()?;
        let (tx, messages) = mpsc::channel(config.queue.max(1));
        let counters = Arc::new(Counters::default());
        let accept = tokio::spawn(accept_loop(listener, config, tx, Arc::clone(&counters)));
        Ok(Pull {
            messages,
            counters,
            local_addr,
            accept,
        })
    }

    /// The next message from any peer, in the order they completed; `None` once the
    /// accept task ended (it does not, short of a panic).
    ///
    /// Cancel-safe.
    pub async fn recv(&mut self) -> Option<Message> {
        self.messages.recv().await
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The counters since the socket was bound.
    pub fn stats(&self) -> PullStats {
        self.counters.snapshot()
    }

    /// A handle that reads the counters, for whoever keeps no hold on the socket (a
    /// metrics collector while a task owns the socket).
    pub fn stats_handle(&self) -> PullStatsHandle {
        PullStatsHandle(Arc::clone(&self.counters))
    }
}

/// Reads a [`Pull`] socket's counters ([`Pull::stats_handle`]); they stay readable
/// after the socket is dropped.
#[derive(Debug, Clone)]
pub struct PullStatsHandle(Arc<Counters>);

impl PullStatsHandle {
    /// The counters now.
    pub fn get(&self) -> PullStats {
        self.0.snapshot()
    }
}

async fn accept_loop(
    listener: TcpListener,
    config: PullConfig,
    tx: mpsc::Sender<Message>,
    counters: Arc<Counters>,
) {
    let mut peers = JoinSet::new();
    let mut live = Live::default();
    let clock = Clock::start();
    loop {
        tokio::select! {
            Some(ended) = peers.join_next_with_id() => {
                let id = match ended {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                };
                live.remove(id);
                counters.peers.store(peers.len() as u64, Ordering::Relaxed);
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, addr)) => {
                    let host = host_of(addr.ip());
                    // Its host's places first, then the socket's: the peer idle longest
                    // among them makes room, if it has been idle long enough; its task
                    // ends (and is reaped) at the abort.
                    let full = if live.of_host(host) >= config.max_peers_per_host.max(1) {
                        Some((Some(host), &counters.refused_per_host, "from its host"))
                    } else if live.peers.len() >= config.max_peers {
                        Some((None, &counters.refused, "in all"))
                    } else {
                        None
                    };
                    if let Some((among, refused, limit)) = full {
                        let now = clock.now();
                        match live.idlest(among) {
                            Some((id, at)) if now.saturating_sub(at) >= config.evict_idle_after => {
                                live.evict(id);
                                counters.evicted.fetch_add(1, Ordering::Relaxed);
                                let idle_ms = now.saturating_sub(at).as_millis();
                                tracing::warn!(%addr, idle_ms, "ZMQ PULL: peer idle longest closed to make room");
                            }
                            _ => {
                                refused.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(%addr, limit, "ZMQ PULL: too many peers, connection closed");
                                drop(stream);
                                continue;
                            }
                        }
                    }
                    counters.accepted.fetch_add(1, Ordering::Relaxed);
                    let heard = Arc::new(Heard::new(&clock));
                    let handle = peers.spawn(peer(
                        stream,
                        addr,
                        config.limits,
                        tx.clone(),
                        Arc::clone(&counters),
                        (Arc::clone(&heard), clock),
                    ));
                    live.insert(handle, host, heard);
                    counters.peers.store(peers.len() as u64, Ordering::Relaxed);
                }
                Err(error) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!(%error, "ZMQ PULL: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// The host a peer at `ip` is counted under: an IPv4 address (an IPv4-mapped IPv6 one
/// too), or an IPv6 address's /64.
fn host_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        },
    }
}

/// The live peers of a [`Pull`]: each one's task, host and when it was last heard
/// from, and how many each host has.
#[derive(Default)]
struct Live {
    peers: HashMap<tokio::task::Id, (AbortHandle, IpAddr, Arc<Heard>)>,
    per_host: HashMap<IpAddr, usize>,
}

impl Live {
    fn insert(&mut self, handle: AbortHandle, host: IpAddr, heard: Arc<Heard>) {
        *self.per_host.entry(host).or_default() += 1;
        self.peers.insert(handle.id(), (handle, host, heard));
    }

    /// Forget the peer `id` (its task ended, or was aborted).
    fn remove(&mut self, id: tokio::task::Id) {
        let Some((_, host, _)) = self.peers.remove(&id) else {
            return;
        };
        if let Some(n) = self.per_host.get_mut(&host) {
            *n -= 1;
            if *n == 0 {
                self.per_host.remove(&host);
            }
        }
    }

    /// Close the peer `id`.
    fn evict(&mut self, id: tokio::task::Id) {
        if let Some((handle, _, _)) = self.peers.get(&id) {
            handle.abort();
        }
        self.remove(id);
    }

    fn of_host(&self, host: IpAddr) -> usize {
        self.per_host.get(&host).copied().unwrap_or(0)
    }

    /// The peer idle longest (of `host` only, when given) and when it was last heard.
    fn idlest(&self, host: Option<IpAddr>) -> Option<(tokio::task::Id, Duration)> {
        self.peers
            .iter()
            .filter(|(_, (_, h, _))| host.is_none_or(|host| *h == host))
            .map(|(id, (_, _, heard))| (*id, heard.at()))
            .min_by_key(|(_, at)| *at)
    }
}

/// When a peer was last heard from, in milliseconds of its socket's [`Clock`].
#[derive(Debug)]
struct Heard(AtomicU64);

/// A socket's time base for [`Heard`].
#[derive(Debug, Clone, Copy)]
struct Clock(tokio::time::Instant);

impl Clock {
    fn start() -> Clock {
        Clock(tokio::time::Instant::now())
    }

    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

impl Heard {
    fn new(clock: &Clock) -> Heard {
        let heard = Heard(AtomicU64::new(0));
        heard.now(clock);
        heard
    }

    /// Heard from now.
    fn now(&self, clock: &Clock) {
        let ms = u64::try_from(clock.now().as_millis()).unwrap_or(u64::MAX);
        self.0.store(ms, Ordering::Relaxed);
    }

    fn at(&self) -> Duration {
        Duration::from_millis(self.0.load(Ordering::Relaxed))
    }
}

async fn peer(
    stream: tokio::net::TcpStream,
    addr: SocketAddr,
    limits: Limits,
    tx: mpsc::Sender<Message>,
    counters: Arc<Counters>,
    (heard, clock): (Arc<Heard>, Clock),
) {
    let result = async {
        let mut conn = Connection::handshake(stream, SocketType::Pull, true, limits).await?;
        heard.now(&clock);
        loop {
            let message = conn.recv().await?;
            heard.now(&clock);
            counters.messages.fetch_add(1, Ordering::Relaxed);
            if tx.send(message).await.is_err() {
                return Ok::<(), Error>(());
            }
        }
    }
    .await;
    if let Err(error) = result {
        let reject = error.reject();
        counters.rejected(reject);
        if reject == Reject::Disconnected {
            tracing::debug!(%addr, %error, "ZMQ PULL: peer left");
        } else {
            tracing::warn!(%addr, %error, "ZMQ PULL: peer disconnected");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_an_ipv4_address_or_an_ipv6_slash_64() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(host_of(ip("10.0.0.7")), ip("10.0.0.7"));
        assert_eq!(host_of(ip("::ffff:10.0.0.7")), ip("10.0.0.7"));
        assert_eq!(host_of(ip("2001:db8:1:2:aaaa::1")), ip("2001:db8:1:2::"));
        assert_eq!(
            host_of(ip("2001:db8:1:2:ffff:ffff:ffff:ffff")),
            host_of(ip("2001:db8:1:2::9"))
        );
        assert_ne!(
            host_of(ip("2001:db8:1:3::1")),
            host_of(ip("2001:db8:1:2::1"))
        );
    }
}
