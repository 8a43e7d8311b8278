//! DNS discovery against a real DNS server: Debian's dnsmasq, started by each test on a
//! loopback port, serving A/AAAA records from a hosts file (re-read on SIGHUP) and SRV
//! records from its command line (changed by a restart on the same port).
//!
//! scripts/test.sh installs dnsmasq when it is missing and then sets
//! DISAGG_REQUIRE_DNSMASQ=1, which makes a missing dnsmasq a failure; without it (a
//! bare `cargo test` on a machine without dnsmasq) the tests say loudly that they are
//! skipped.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use disagg_core::endpoint::Facts;
use disagg_core::{EndpointSource, Role};
use disagg_discovery::MergedSource;
use disagg_discovery::dns::{self, DnsConfig, DnsTarget};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::support::{TempDir, eventually, ids, wait_for};

/// Well under the refresh bounds the tests configure, so that a change seen within it
/// was seen because of the TTL (or the bound) under test.
const SEEN: Duration = Duration::from_secs(10);

/// The merged source of one DNS source over `config`, its first list not waited for.
async fn merged_over(config: DnsConfig) -> MergedSource {
    MergedSource::builder()
        .source(dns::spawn(config).await.unwrap())
        .build()
}

/// The dnsmasq binary, or `None` (after saying so) when the test must be skipped.
fn dnsmasq_binary() -> Option<PathBuf> {
    for dir in ["/usr/sbin", "/usr/bin", "/sbin", "/bin", "/usr/local/sbin"] {
        let path = Path::new(dir).join("dnsmasq");
        if path.exists() {
            return Some(path);
        }
    }
    // Under CI (`CI=true`) or scripts/test.sh (DISAGG_REQUIRE_DNSMASQ=1) a missing
    // dnsmasq fails the test: a green run must mean the DNS test ran.
    let required = std::env::var_os("DISAGG_REQUIRE_DNSMASQ").is_some_and(|v| v == "1")
        || std::env::var_os("CI").is_some_and(|v| v == "true");
    if required {
        panic!(
            "dnsmasq is required (CI=true or DISAGG_REQUIRE_DNSMASQ=1) but not installed: \
             apt-get install dnsmasq-base, or run scripts/test.sh"
        );
    }
    eprintln!(
        "\n\n!!!!!!!! SKIPPED: dnsmasq is not installed, so the DNS discovery test did not \
         run. Install it (apt-get install dnsmasq-base) or run scripts/test.sh, which \
         does. !!!!!!!!\n"
    );
    None
}

/// A dnsmasq serving `hosts` (a hosts file) and `srv` (`--srv-host` values) for the
/// local domain `disagg.test` on 127.0.0.1.
struct Dnsmasq {
    binary: PathBuf,
    child: Option<Child>,
    port: u16,
    hosts: PathBuf,
    srv: Vec<String>,
    ttl: u32,
    /// More command-line options (`--server=/zone/IP#PORT` forwarding).
    extra: Vec<String>,
}

impl Dnsmasq {
    async fn start(dir: &TempDir, hosts: &str, srv: &[&str], ttl: u32) -> Option<Dnsmasq> {
        Dnsmasq::start_with(dir, hosts, srv, ttl, &[]).await
    }

    /// As [`Dnsmasq::start`], with more command-line options.
    async fn start_with(
        dir: &TempDir,
        hosts: &str,
        srv: &[&str],
        ttl: u32,
        extra: &[String],
    ) -> Option<Dnsmasq> {
        let binary = dnsmasq_binary()?;
        let path = dir.path().join("hosts");
        std::fs::write(&path, hosts).unwrap();
        let mut server = Dnsmasq {
            binary,
            child: None,
            port: 0,
            hosts: path,
            srv: srv.iter().map(|s| (*s).to_owned()).collect(),
            ttl,
            extra: extra.to_vec(),
        };
        // A port free for both UDP and TCP now; another process may take it before
        // dnsmasq binds, so try a few.
        for _ in 0..5 {
            server.port = free_port();
            if server.spawn().await {
                return Some(server);
            }
        }
        panic!("dnsmasq did not start on any of 5 ports");
    }

    /// Starts dnsmasq on `self.port`; whether it started.
    async fn spawn(&mut self) -> bool {
        let mut cmd = Command::new(&self.binary);
        // In the foreground but not in debug mode (`--no-daemon`): in debug mode dnsmasq
        // serves a TCP connection in its one process, answering nothing else until the
        // client closes it, where a deployed dnsmasq forks a process per connection. An
        // SRV answer too large for UDP is asked again over TCP, and the resolver keeps
        // that connection open: in debug mode the targets' lookups after it went
        // unanswered until the lookup timeout had passed. `--user=root` keeps it from
        // changing user (dnsmasq changes to no user with uid 0): it stays the user who
        // started it, who can read the hosts file.
        cmd.arg("--keep-in-foreground")
            .arg("--user=root")
            .arg(format!("--port={}", self.port))
            .arg("--listen-address=127.0.0.1")
            .arg("--bind-interfaces")
            .arg("--no-resolv")
            .arg("--no-hosts")
            .arg("--conf-file=/dev/null")
            .arg("--pid-file=")
            .arg("--log-facility=-")
            // Names under disagg.test are answered from local data only: a name not
            // there is NXDOMAIN, not REFUSED for want of an upstream server.
            .arg("--local=/disagg.test/")
            .arg(format!("--local-ttl={}", self.ttl))
            .arg(format!("--addn-hosts={}", self.hosts.display()));
        for srv in &self.srv {
            cmd.arg(format!("--srv-host={srv}"));
        }
        cmd.args(&self.extra);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("dnsmasq runs");
        let stderr = child.stderr.take().unwrap();
        let mut lines = BufReader::new(stderr).lines();
        let started = tokio::time::timeout(Duration::from_secs(10), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("started, version") {
                    return true;
                }
                if line.contains("failed") || line.contains("FAILED") {
                    eprintln!("dnsmasq: {line}");
                }
            }
            false
        })
        .await
        .unwrap_or(false);
        if !started {
            let _ = child.kill().await;
            return false;
        }
        // Keep reading its log so that dnsmasq never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        self.child = Some(child);
        true
    }

    fn server(&self) -> std::net::SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }

    /// New hosts-file records, re-read on SIGHUP.
    async fn set_hosts(&mut self, hosts: &str) {
        let tmp = self.hosts.with_extension("tmp");
        std::fs::write(&tmp, hosts).unwrap();
        std::fs::rename(&tmp, &self.hosts).unwrap();
        let pid = self
            .child
            .as_ref()
            .and_then(Child::id)
            .expect("dnsmasq runs");
        let hup = std::process::Command::new("kill")
            .args(["-HUP", &pid.to_string()])
            .status();
        if !hup.is_ok_and(|s| s.success()) {
            // No kill(1) here: a restart reads the file too.
            self.restart().await;
        }
    }

    /// New SRV records: dnsmasq reads them from its command line, so a restart.
    async fn set_srv(&mut self, srv: &[&str]) {
        self.srv = srv.iter().map(|s| (*s).to_owned()).collect();
        self.restart().await;
    }

    async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    async fn restart(&mut self) {
        self.stop().await;
        // The killed process's sockets may take a moment to be released on a loaded
        // machine: the same port (the resolver under test keeps asking it) is retried.
        for _ in 0..20 {
            if self.spawn().await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("dnsmasq did not restart on port {}", self.port);
    }
}

fn free_port() -> u16 {
    loop {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = udp.local_addr().unwrap().port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

fn config(server: &Dnsmasq, targets: Vec<DnsTarget>) -> DnsConfig {
    let mut config = DnsConfig::new(targets);
    config.server = Some(server.server());
    config
}

fn target(name: &str, role: Role) -> DnsTarget {
    DnsTarget::new(name.parse().unwrap(), role)
}

fn errors(merged: &MergedSource) -> u64 {
    merged.sources().next().unwrap().1.errors()
}

#[tokio::test]
async fn a_names_addresses_follow_its_ttl_and_a_removed_name_has_no_engines() {
    let dir = TempDir::new("dns-a");
    let hosts = "127.0.0.11 prefill.disagg.test\n127.0.0.12 prefill.disagg.test\n\
                 fd00::11 prefill.disagg.test\n127.0.0.21 decode.disagg.test\n";
    // A TTL of 1 s against a refresh bound of 60 s: a change seen within 10 s was seen
    // because the TTL ran out.
    let Some(mut server) = Dnsmasq::start(&dir, hosts, &[], 1).await else {
        return;
    };
    let mut prefill = target("prefill.disagg.test:8100", Role::Prefill);
    prefill.bootstrap_port = Some(8998);
    let mut config = config(
        &server,
        vec![prefill, target("decode.disagg.test:8200", Role::Decode)],
    );
    config.max_refresh = Duration::from_secs(60);
    let merged = merged_over(config).await;
    merged.synced().await;
    let first = merged.snapshot();
    assert_eq!(
        ids(&first, Role::Prefill),
        [
            "http://127.0.0.11:8100",
            "http://127.0.0.12:8100",
            "http://[fd00::11]:8100"
        ]
    );
    assert_eq!(ids(&first, Role::Decode), ["http://127.0.0.21:8200"]);
    assert!(
        first
            .by_role(Role::Prefill)
            .iter()
            .all(|e| { e.facts().get(Facts::BOOTSTRAP_PORT) == Some("8998") })
    );
    let kept = first
        .by_role(Role::Prefill)
        .iter()
        .find(|e| e.id().as_str() == "http://127.0.0.12:8100")
        .cloned()
        .unwrap();

    server
        .set_hosts("127.0.0.12 prefill.disagg.test\n127.0.0.13 prefill.disagg.test\n127.0.0.21 decode.disagg.test\n")
        .await;
    let second = wait_for(&merged, SEEN, "the new addresses", |s| {
        ids(s, Role::Prefill) == ["http://127.0.0.12:8100", "http://127.0.0.13:8100"]
    })
    .await;
    let still = second
        .by_role(Role::Prefill)
        .iter()
        .find(|e| e.id().as_str() == "http://127.0.0.12:8100")
        .unwrap();
    assert!(
        Arc::ptr_eq(still, &kept),
        "an address that stays keeps its endpoint"
    );

    // The decode name removed: NXDOMAIN is an answer, the name has no engines.
    server
        .set_hosts("127.0.0.12 prefill.disagg.test\n127.0.0.13 prefill.disagg.test\n")
        .await;
    wait_for(&merged, SEEN, "the removed name", |s| {
        s.by_role(Role::Decode).is_empty()
    })
    .await;
    assert_eq!(errors(&merged), 0, "no lookup failed");
}

#[tokio::test]
async fn an_encode_name_gives_encoder_endpoints_and_no_prefill() {
    // The proxy's `--encode-dns NAME:PORT` is a target of role `encode`.
    let dir = TempDir::new("dns-encode");
    let hosts = "127.0.0.31 encode.disagg.test\n127.0.0.32 encode.disagg.test\n\
                 127.0.0.21 decode.disagg.test\n";
    let Some(server) = Dnsmasq::start(&dir, hosts, &[], 1).await else {
        return;
    };
    let config = config(
        &server,
        vec![
            target("encode.disagg.test:8300", Role::Encode),
            target("decode.disagg.test:8200", Role::Decode),
        ],
    );
    let merged = merged_over(config).await;
    merged.synced().await;
    let set = merged.snapshot();
    assert_eq!(
        ids(&set, Role::Encode),
        ["http://127.0.0.31:8300", "http://127.0.0.32:8300"]
    );
    assert_eq!(ids(&set, Role::Decode), ["http://127.0.0.21:8200"]);
    assert!(
        set.by_role(Role::Prefill).is_empty(),
        "an encoder is no prefill"
    );
    assert_eq!(errors(&merged), 0, "no lookup failed");
}

#[tokio::test]
async fn the_refresh_bound_caps_a_long_ttl() {
    let dir = TempDir::new("dns-bound");
    let Some(mut server) = Dnsmasq::start(&dir, "127.0.0.41 d.disagg.test\n", &[], 3600).await
    else {
        return;
    };
    let mut config = config(&server, vec![target("d.disagg.test:8200", Role::Decode)]);
    config.max_refresh = Duration::from_secs(1);
    let merged = merged_over(config).await;
    merged.synced().await;
    assert_eq!(
        ids(&merged.snapshot(), Role::Decode),
        ["http://127.0.0.41:8200"]
    );
    // The records say an hour; the bound says a second.
    server.set_hosts("127.0.0.42 d.disagg.test\n").await;
    wait_for(&merged, SEEN, "the change despite the TTL", |s| {
        ids(s, Role::Decode) == ["http://127.0.0.42:8200"]
    })
    .await;
}

#[tokio::test]
async fn srv_records_give_the_lowest_prioritys_targets_and_ports() {
    let dir = TempDir::new("dns-srv");
    let hosts = "127.0.0.31 d1.disagg.test\n127.0.0.32 d2.disagg.test\n127.0.0.33 d3.disagg.test\n";
    let srv = [
        "_vllm._tcp.disagg.test,d1.disagg.test,8201,0,10",
        "_vllm._tcp.disagg.test,d2.disagg.test,8202,0,10",
        // A fallback (higher priority value): not used while the others exist.
        "_vllm._tcp.disagg.test,d3.disagg.test,8203,1,10",
    ];
    let Some(mut server) = Dnsmasq::start(&dir, hosts, &srv, 1).await else {
        return;
    };
    let mut config = config(
        &server,
        vec![target("_vllm._tcp.disagg.test", Role::Decode)],
    );
    config.max_refresh = Duration::from_secs(60);
    let merged = merged_over(config).await;
    merged.synced().await;
    assert_eq!(
        ids(&merged.snapshot(), Role::Decode),
        ["http://127.0.0.31:8201", "http://127.0.0.32:8202"]
    );
    // The records' weight (10) is the endpoints' routing weight.
    let weights: Vec<f64> = merged
        .snapshot()
        .by_role(Role::Decode)
        .iter()
        .map(|e| e.weight())
        .collect();
    assert_eq!(weights, [10.0, 10.0]);
    // d2 goes, d1 moves to another port.
    server
        .set_srv(&[
            "_vllm._tcp.disagg.test,d1.disagg.test,8211,0,10",
            "_vllm._tcp.disagg.test,d3.disagg.test,8203,1,10",
        ])
        .await;
    wait_for(&merged, SEEN, "the new SRV records", |s| {
        ids(s, Role::Decode) == ["http://127.0.0.31:8211"]
    })
    .await;
    // Only the fallback left: it is the lowest priority now.
    server
        .set_srv(&["_vllm._tcp.disagg.test,d3.disagg.test,8203,1,10"])
        .await;
    wait_for(&merged, SEEN, "the fallback", |s| {
        ids(s, Role::Decode) == ["http://127.0.0.33:8203"]
    })
    .await;
}

/// A name whose answers make more engines than the ceiling fails as a lookup does (the
/// last good engines kept, an error counted), before the rest of its targets are
/// resolved; back under it, its engines follow.
#[tokio::test]
async fn a_name_past_the_endpoint_ceiling_is_refused_as_it_is_resolved() {
    let dir = TempDir::new("dns-many");
    let hosts = "127.0.0.61 m1.disagg.test\n127.0.0.62 m1.disagg.test\n\
                 127.0.0.63 m2.disagg.test\n127.0.0.64 m2.disagg.test\n\
                 127.0.0.65 m3.disagg.test\n127.0.0.66 m3.disagg.test\n";
    let three = [
        "_many._tcp.disagg.test,m1.disagg.test,8201,0,10",
        "_many._tcp.disagg.test,m2.disagg.test,8202,0,10",
        "_many._tcp.disagg.test,m3.disagg.test,8203,0,10",
    ];
    let Some(mut server) = Dnsmasq::start(&dir, hosts, &three[..2], 1).await else {
        return;
    };
    let mut config = config(
        &server,
        vec![target("_many._tcp.disagg.test", Role::Decode)],
    );
    config.max_endpoints = 5;
    config.max_refresh = Duration::from_secs(1);
    config.min_refresh = Duration::from_millis(200);
    let merged = merged_over(config).await;
    merged.synced().await;
    let before = merged.snapshot();
    assert_eq!(ids(&before, Role::Decode).len(), 4);
    // Six engines: past the ceiling of five.
    server.set_srv(&three).await;
    eventually(Duration::from_secs(15), "a refused lookup", || {
        errors(&merged) >= 1
    })
    .await;
    assert!(
        Arc::ptr_eq(&merged.snapshot(), &before),
        "the last good engines kept"
    );
    // Back to four.
    server.set_srv(&three[1..]).await;
    wait_for(&merged, SEEN, "the engines under the ceiling", |s| {
        ids(s, Role::Decode)
            == [
                "http://127.0.0.63:8202",
                "http://127.0.0.64:8202",
                "http://127.0.0.65:8203",
                "http://127.0.0.66:8203",
            ]
    })
    .await;
}

#[tokio::test]
async fn a_failed_lookup_keeps_the_last_good_engines() {
    let dir = TempDir::new("dns-fail");
    let Some(mut server) = Dnsmasq::start(&dir, "127.0.0.51 d.disagg.test\n", &[], 1).await else {
        return;
    };
    let mut config = config(&server, vec![target("d.disagg.test:8200", Role::Decode)]);
    config.max_refresh = Duration::from_secs(1);
    config.min_refresh = Duration::from_millis(200);
    config.timeout = Duration::from_millis(200);
    let merged = merged_over(config).await;
    merged.synced().await;
    let before = merged.snapshot();
    assert_eq!(ids(&before, Role::Decode), ["http://127.0.0.51:8200"]);

    // No server: lookups fail (refused or timed out), the engines stay.
    server.stop().await;
    eventually(Duration::from_secs(15), "two failed lookups", || {
        errors(&merged) >= 2
    })
    .await;
    assert!(
        Arc::ptr_eq(&merged.snapshot(), &before),
        "the set was kept as it was"
    );

    // The server back with other records: the set follows.
    std::fs::write(&server.hosts, "127.0.0.52 d.disagg.test\n").unwrap();
    server.restart().await;
    wait_for(&merged, SEEN, "recovery", |s| {
        ids(s, Role::Decode) == ["http://127.0.0.52:8200"]
    })
    .await;
}

/// A name none of whose lookups answered yet makes the source publish nothing (`None`,
/// not an empty list): the source's first list is a complete one.
#[tokio::test]
async fn a_name_that_never_answered_publishes_nothing() {
    // A closed port on loopback: every lookup fails (refused or timed out).
    let mut config = DnsConfig::new([target("d.disagg.test:8200", Role::Decode)]);
    config.server = Some(([127, 0, 0, 1], free_port()).into());
    config.timeout = Duration::from_millis(100);
    config.min_refresh = Duration::from_millis(100);
    config.max_refresh = Duration::from_millis(400);
    config.first_list_wait = Duration::from_secs(3600);
    let source = dns::spawn(config).await.unwrap();
    assert!(
        source.watch().borrow().is_none(),
        "nothing after the first round"
    );
    assert!(source.stats().errors() >= 1);
    eventually(Duration::from_secs(15), "more failed rounds", || {
        source.stats().errors() >= 3
    })
    .await;
    assert!(
        source.watch().borrow().is_none(),
        "nothing after later rounds"
    );
    assert_eq!(source.stats().updates(), 0);
}

/// One name that never answers holds the others' engines back for `first_list_wait`,
/// not for ever: then the names that answered are published, and the failing one
/// joins when it answers.
#[tokio::test]
async fn a_name_that_never_answers_holds_the_first_list_back_for_a_bounded_wait() {
    let dir = TempDir::new("dns-first-wait");
    // `good` has one address; `bad` has three, past a ceiling of two: its lookup fails
    // as a server error does, on every refresh.
    let hosts = "127.0.0.81 good.disagg.test\n127.0.0.82 bad.disagg.test\n\
                 127.0.0.83 bad.disagg.test\n127.0.0.84 bad.disagg.test\n";
    let Some(mut server) = Dnsmasq::start(&dir, hosts, &[], 1).await else {
        return;
    };
    let mut config = config(
        &server,
        vec![
            target("good.disagg.test:8200", Role::Decode),
            target("bad.disagg.test:8200", Role::Decode),
        ],
    );
    config.max_endpoints = 2;
    config.min_refresh = Duration::from_millis(200);
    config.max_refresh = Duration::from_secs(1);
    config.first_list_wait = Duration::from_secs(2);
    let started = std::time::Instant::now();
    let source = dns::spawn(config).await.unwrap();
    assert!(
        source.watch().borrow().is_none(),
        "no partial first list while the wait runs"
    );
    let merged = MergedSource::builder().source(source).build();
    tokio::time::timeout(SEEN, merged.synced())
        .await
        .expect("a first list once the wait is over");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "not before the wait is over"
    );
    assert_eq!(
        ids(&merged.snapshot(), Role::Decode),
        ["http://127.0.0.81:8200"]
    );
    // The failing name answers within the ceiling: it joins.
    server
        .set_hosts("127.0.0.81 good.disagg.test\n127.0.0.82 bad.disagg.test\n")
        .await;
    wait_for(&merged, SEEN, "the late name's engine", |s| {
        ids(s, Role::Decode) == ["http://127.0.0.81:8200", "http://127.0.0.82:8200"]
    })
    .await;
}

/// SRV records naming one target (and port) many times resolve it once and count its
/// engines once against the ceiling.
#[tokio::test]
async fn srv_records_naming_one_target_many_times_resolve_it_once() {
    let dir = TempDir::new("dns-srv-repeat");
    let srv: Vec<String> = (1..=10)
        .map(|w| format!("_rep._tcp.disagg.test,r1.disagg.test,8201,0,{w}"))
        .collect();
    let srv: Vec<&str> = srv.iter().map(String::as_str).collect();
    let Some(server) = Dnsmasq::start(&dir, "127.0.0.71 r1.disagg.test\n", &srv, 1).await else {
        return;
    };
    let mut config = config(&server, vec![target("_rep._tcp.disagg.test", Role::Decode)]);
    config.max_endpoints = 5;
    let merged = merged_over(config).await;
    tokio::time::timeout(SEEN, merged.synced())
        .await
        .expect("the name's first list");
    assert_eq!(
        ids(&merged.snapshot(), Role::Decode),
        ["http://127.0.0.71:8201"]
    );
    assert_eq!(errors(&merged), 0, "not refused as too many");
}

/// An SRV answer naming more distinct targets than are resolved per name and round
/// (256) is cut there: the first 256 targets' engines, no error.
#[tokio::test]
async fn srv_targets_past_the_cap_are_cut() {
    let dir = TempDir::new("dns-srv-cap");
    let hosts: String = (0..300)
        .map(|i| format!("127.0.{}.{} t{i}.disagg.test\n", 2 + i / 250, 1 + i % 250))
        .collect();
    let srv: Vec<String> = (0..300)
        .map(|i| format!("_cap._tcp.disagg.test,t{i}.disagg.test,8201,0,10"))
        .collect();
    let srv: Vec<&str> = srv.iter().map(String::as_str).collect();
    let Some(server) = Dnsmasq::start(&dir, &hosts, &srv, 60).await else {
        return;
    };
    let mut config = config(&server, vec![target("_cap._tcp.disagg.test", Role::Decode)]);
    config.max_refresh = Duration::from_secs(60);
    let merged = merged_over(config).await;
    tokio::time::timeout(Duration::from_secs(60), merged.synced())
        .await
        .expect("the name's first list");
    assert_eq!(merged.snapshot().by_role(Role::Decode).len(), 256);
    assert_eq!(errors(&merged), 0);
}

/// An SRV answer too large for UDP (asked again over TCP) and its targets' lookups
/// after it finish within a round trip's time, not after the lookup timeout: the
/// first list arrives well before `timeout` has passed once.
#[tokio::test]
async fn an_srv_answer_over_tcp_does_not_hold_its_targets_lookups_for_the_timeout() {
    let dir = TempDir::new("dns-srv-tcp");
    let hosts: String = (0..100)
        .map(|i| format!("127.0.3.{} u{i}.disagg.test\n", 1 + i))
        .collect();
    let srv: Vec<String> = (0..100)
        .map(|i| format!("_big._tcp.disagg.test,u{i}.disagg.test,8201,0,10"))
        .collect();
    let srv: Vec<&str> = srv.iter().map(String::as_str).collect();
    let Some(server) = Dnsmasq::start(&dir, &hosts, &srv, 60).await else {
        return;
    };
    let mut config = config(&server, vec![target("_big._tcp.disagg.test", Role::Decode)]);
    config.max_refresh = Duration::from_secs(60);
    config.timeout = Duration::from_secs(10);
    // `spawn` returns once the first refresh is done (or its bounded wait is over).
    let merged = tokio::time::timeout(Duration::from_secs(4), async {
        let merged = merged_over(config).await;
        merged.synced().await;
        merged
    })
    .await
    .expect("the name's first list, well before the 10 s lookup timeout");
    assert_eq!(merged.snapshot().by_role(Role::Decode).len(), 100);
    assert_eq!(errors(&merged), 0);
}

/// A DNS server on a loopback UDP port for the zone dnsmasq forwards to it, which holds
/// every query until it has been asked about `names` distinct names, then answers them
/// all, and every later query at once: a name `gN.gate.test` has the address
/// 127.0.9.(N+1) (and no AAAA record).
struct Gate {
    port: u16,
    seen: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Gate {
    async fn start(names: usize) -> Gate {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let port = socket.local_addr().unwrap().port();
        let seen = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
        let task = tokio::spawn({
            let seen = seen.clone();
            async move {
                let mut held = Vec::new();
                let mut buf = [0u8; 1500];
                while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                    let Some((name, reply)) = gate_reply(&buf[..n]) else {
                        continue;
                    };
                    held.push((from, reply));
                    let open = {
                        let mut seen = seen.lock().unwrap();
                        seen.insert(name);
                        seen.len() >= names
                    };
                    if open {
                        for (to, reply) in held.drain(..) {
                            let _ = socket.send_to(&reply, to).await;
                        }
                    }
                }
            }
        });
        Gate { port, seen, task }
    }

    fn seen(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The query's name (lowercase) and the gate's answer to it: for `gN.gate.test` type A,
/// the address 127.0.9.(N+1); for anything else, no records. `None` for what is no
/// query.
fn gate_reply(query: &[u8]) -> Option<(String, Vec<u8>)> {
    if query.len() < 12 || query[2] & 0x80 != 0 || query[4..6] != [0, 1] {
        return None;
    }
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*query.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        if len & 0xC0 != 0 {
            return None;
        }
        labels.push(String::from_utf8_lossy(query.get(at..at + len)?).to_lowercase());
        at += len;
    }
    let question_end = at + 4;
    let qtype = query.get(at..at + 2)?;
    let name = labels.join(".");
    let address = labels
        .first()
        .and_then(|l| l.strip_prefix('g'))
        .and_then(|n| n.parse::<u8>().ok())
        .filter(|_| qtype == [0, 1] && labels.len() == 3 && labels[1..] == ["gate", "test"]);
    let mut reply = Vec::with_capacity(question_end + 16);
    reply.extend_from_slice(&query[..2]);
    // A response (QR), the query's opcode and RD, authoritative (AA); RA, no error.
    reply.push(0x80 | (query[2] & 0x79) | 0x04);
    reply.push(0x80);
    reply.extend_from_slice(&[0, 1, 0, u8::from(address.is_some()), 0, 0, 0, 0]);
    reply.extend_from_slice(query.get(12..question_end)?);
    if let Some(n) = address {
        // The question's name (a pointer to offset 12), type A, class IN, TTL 60.
        reply.extend_from_slice(&[0xC0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        reply.extend_from_slice(&[127, 0, 9, n + 1]);
    }
    Some((name, reply))
}

/// An SRV name's targets are looked up together, not one after another: their
/// addresses come from a server (dnsmasq forwards their zone to it) that answers none
/// of the eight targets until it has been asked about all of them, so a resolution that
/// waits for one target's answer before asking about the next never completes (its
/// lookups' time limit is past the test's wait).
#[tokio::test]
async fn srv_targets_are_looked_up_together() {
    let dir = TempDir::new("dns-srv-together");
    let gate = Gate::start(8).await;
    let srv: Vec<String> = (0..8)
        .map(|i| format!("_gate._tcp.disagg.test,g{i}.gate.test,8201,0,10"))
        .collect();
    let srv: Vec<&str> = srv.iter().map(String::as_str).collect();
    let forward = format!("--server=/gate.test/127.0.0.1#{}", gate.port);
    let Some(server) = Dnsmasq::start_with(&dir, "", &srv, 60, &[forward]).await else {
        return;
    };
    let mut config = config(
        &server,
        vec![target("_gate._tcp.disagg.test", Role::Decode)],
    );
    // A lookup held at the gate is no failure within the test's wait: one after
    // another, the first target's lookup waits there until the test gives up.
    config.timeout = Duration::from_secs(60);
    config.max_refresh = Duration::from_secs(60);
    let resolved = tokio::time::timeout(SEEN, async {
        let merged = merged_over(config).await;
        merged.synced().await;
        merged
    })
    .await;
    let Ok(merged) = resolved else {
        panic!(
            "the name's first list not within {SEEN:?}: the gate was asked about {} of the 8 \
             targets at once",
            gate.seen()
        );
    };
    let want: Vec<String> = (1..=8)
        .map(|n| format!("http://127.0.9.{n}:8201"))
        .collect();
    assert_eq!(ids(&merged.snapshot(), Role::Decode), want);
    assert_eq!(errors(&merged), 0);
}

/// A name whose server never answers holds no other name's refresh back: while its
/// lookup waits out the lookup timeout (8 s), a change of another name's records is
/// published within a few of that name's refreshes (its TTL is 1 s), not after the
/// timeout. The silent server is a loopback UDP socket that dnsmasq forwards the
/// `hole.test` zone to; it counts the queries it is sent and answers none.
#[tokio::test]
async fn a_name_that_never_answers_holds_no_other_names_refresh_back() {
    let dir = TempDir::new("dns-never-alongside");
    let hole = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let forward = format!(
        "--server=/hole.test/127.0.0.1#{}",
        hole.local_addr().unwrap().port()
    );
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let silent = tokio::spawn({
        let asked = asked.clone();
        async move {
            let mut buf = [0u8; 1500];
            while hole.recv_from(&mut buf).await.is_ok() {
                asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    });
    let Some(mut server) =
        Dnsmasq::start_with(&dir, "127.0.0.91 good.disagg.test\n", &[], 1, &[forward]).await
    else {
        return;
    };
    let mut config = config(
        &server,
        vec![
            target("never.hole.test:8200", Role::Decode),
            target("good.disagg.test:8200", Role::Decode),
        ],
    );
    config.timeout = Duration::from_secs(8);
    config.min_refresh = Duration::from_millis(200);
    config.max_refresh = Duration::from_secs(1);
    config.first_list_wait = Duration::from_millis(500);
    let merged = merged_over(config).await;
    merged.synced().await;
    assert_eq!(
        ids(&merged.snapshot(), Role::Decode),
        ["http://127.0.0.91:8200"]
    );
    // The silent name's first lookup has failed (`spawn` returned): once it is asked
    // again, its next lookup is under way for the next 8 s.
    let before = asked.load(std::sync::atomic::Ordering::SeqCst);
    eventually(SEEN, "the silent name asked again", || {
        asked.load(std::sync::atomic::Ordering::SeqCst) > before
    })
    .await;
    server.set_hosts("127.0.0.92 good.disagg.test\n").await;
    wait_for(
        &merged,
        Duration::from_secs(3),
        "the good name's change while the silent one's lookup waits",
        |s| ids(s, Role::Decode) == ["http://127.0.0.92:8200"],
    )
    .await;
    assert!(errors(&merged) >= 1, "the silent name's lookup failed");
    silent.abort();
}

/// How a [`Zone`] answers one address family's queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// One address: 127.0.8.N (A) or fd00::8N (AAAA), N from 1 to 9, with a TTL of 0.
    Address(u8),
    /// No error and no records (the name has no address of the family).
    NoData,
    /// No answer at all: the query times out.
    Silent,
    /// SERVFAIL.
    ServFail,
}

/// A DNS server on a loopback UDP port for the `fam.test` zone (dnsmasq forwards it
/// there), answering each family's queries as told: A first, AAAA second.
struct Zone {
    port: u16,
    answers: Arc<std::sync::Mutex<[Answer; 2]>>,
    task: tokio::task::JoinHandle<()>,
}

impl Zone {
    async fn start(a: Answer, aaaa: Answer) -> Zone {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let port = socket.local_addr().unwrap().port();
        let answers = Arc::new(std::sync::Mutex::new([a, aaaa]));
        let task = tokio::spawn({
            let answers = answers.clone();
            async move {
                let mut buf = [0u8; 1500];
                while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                    let now = *answers.lock().unwrap();
                    if let Some(reply) = zone_reply(&buf[..n], now) {
                        let _ = socket.send_to(&reply, from).await;
                    }
                }
            }
        });
        Zone {
            port,
            answers,
            task,
        }
    }

    fn set(&self, a: Answer, aaaa: Answer) {
        *self.answers.lock().unwrap() = [a, aaaa];
    }

    /// dnsmasq's option forwarding the zone here.
    fn forward(&self) -> String {
        format!("--server=/fam.test/127.0.0.1#{}", self.port)
    }
}

impl Drop for Zone {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The zone's reply to `query` (`None`: no reply): A and AAAA answered as `answers`
/// say, any other type without records.
fn zone_reply(query: &[u8], answers: [Answer; 2]) -> Option<Vec<u8>> {
    if query.len() < 12 || query[2] & 0x80 != 0 || query[4..6] != [0, 1] {
        return None;
    }
    let mut at = 12;
    loop {
        let len = usize::from(*query.get(at)?);
        at += 1 + len;
        if len == 0 {
            break;
        }
        if len & 0xC0 != 0 {
            return None;
        }
    }
    let question_end = at + 4;
    let answer = match query.get(at..at + 2)? {
        [0, 1] => answers[0],
        [0, 28] => answers[1],
        _ => Answer::NoData,
    };
    let rdata: Vec<u8> = match (answer, query.get(at + 1)?) {
        (Answer::Silent, _) => return None,
        (Answer::NoData | Answer::ServFail, _) => Vec::new(),
        (Answer::Address(n), 1) => vec![127, 0, 8, n],
        (Answer::Address(n), _) => vec![0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x80 + n],
    };
    let mut reply = Vec::with_capacity(question_end + 32);
    reply.extend_from_slice(&query[..2]);
    // A response (QR), the query's opcode and RD, authoritative (AA); RA, no error or
    // SERVFAIL (2).
    reply.push(0x80 | (query[2] & 0x79) | 0x04);
    reply.push(0x80 | if answer == Answer::ServFail { 2 } else { 0 });
    reply.extend_from_slice(&[0, 1, 0, u8::from(!rdata.is_empty()), 0, 0, 0, 0]);
    reply.extend_from_slice(query.get(12..question_end)?);
    if !rdata.is_empty() {
        // The question's name (a pointer to offset 12), its type, class IN, TTL 0.
        reply.extend_from_slice(&[0xC0, 12]);
        reply.extend_from_slice(query.get(at..at + 2)?);
        reply.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, rdata.len() as u8]);
        reply.extend_from_slice(&rdata);
    }
    Some(reply)
}

/// A dnsmasq forwarding `fam.test` to `zone` (and serving the SRV records `srv`), and
/// the merged source of the decode name `name` resolved through it, once its first
/// list is in.
async fn through_zone(
    dir: &TempDir,
    zone: &Zone,
    name: &str,
    srv: &[&str],
) -> Option<(Dnsmasq, MergedSource)> {
    // Nothing cached: each refresh reaches the zone.
    let extra = [zone.forward(), "--no-negcache".to_owned()];
    let server = Dnsmasq::start_with(dir, "", srv, 0, &extra).await?;
    let mut config = config(&server, vec![target(name, Role::Decode)]);
    // Long enough for a correct answer on a loaded machine (a timed-out one would count
    // an error the tests do not expect), short enough for the silent zone's lookups.
    config.timeout = Duration::from_secs(1);
    config.min_refresh = Duration::from_millis(200);
    config.max_refresh = Duration::from_secs(1);
    let merged = merged_over(config).await;
    tokio::time::timeout(SEEN, merged.synced())
        .await
        .expect("the name's first list");
    Some((server, merged))
}

/// Waits for `more` failed lookups past those counted now, failing the test as soon as
/// the set changes instead.
async fn failed_lookups_keep(merged: &MergedSource, more: u64, what: &str) {
    let before = merged.snapshot();
    let errors_before = errors(merged);
    eventually(SEEN, what, || {
        errors(merged) >= errors_before + more || !Arc::ptr_eq(&merged.snapshot(), &before)
    })
    .await;
    assert!(
        Arc::ptr_eq(&merged.snapshot(), &before),
        "{what}: the set changed to {:?} instead of keeping {:?}",
        ids(&merged.snapshot(), Role::Decode),
        ids(&before, Role::Decode)
    );
}

/// Each address family is asked on its own. A family that fails (a timeout here)
/// beside one that answers keeps its own last good engines, not known to be gone,
/// beside the answering family's new ones, and counts an error: the IPv4 engine
/// follows the A records while the AAAA lookups time out. Clean answers without
/// records are an answer: the name's engines follow them.
#[tokio::test]
async fn a_family_that_fails_beside_one_that_answers_keeps_its_own_engines() {
    let dir = TempDir::new("dns-family-half");
    let zone = Zone::start(Answer::Address(1), Answer::Address(1)).await;
    let Some((_server, merged)) = through_zone(&dir, &zone, "d.fam.test:8200", &[]).await else {
        return;
    };
    assert_eq!(
        ids(&merged.snapshot(), Role::Decode),
        ["http://127.0.8.1:8200", "http://[fd00::81]:8200"]
    );
    // AAAA times out while the A record changes: the new IPv4 engine, the IPv6 kept.
    let errors_before = errors(&merged);
    zone.set(Answer::Address(2), Answer::Silent);
    wait_for(
        &merged,
        SEEN,
        "the new IPv4 engine beside the kept IPv6 one",
        |s| ids(s, Role::Decode) == ["http://127.0.8.2:8200", "http://[fd00::81]:8200"],
    )
    .await;
    eventually(SEEN, "the AAAA timeout counted", || {
        errors(&merged) > errors_before
    })
    .await;
    // AAAA answers without records: the name has only its IPv4 engine now.
    zone.set(Answer::Address(2), Answer::NoData);
    wait_for(&merged, SEEN, "the IPv6 engine gone", |s| {
        ids(s, Role::Decode) == ["http://127.0.8.2:8200"]
    })
    .await;
}

/// An IPv6-only name whose AAAA lookups time out while A answers "no records" keeps
/// its engines: the A family's clean negative answer is not the name's answer.
#[tokio::test]
async fn a_family_that_fails_beside_one_without_records_keeps_the_names_engines() {
    let dir = TempDir::new("dns-family-none");
    let zone = Zone::start(Answer::NoData, Answer::Address(1)).await;
    let Some((_server, merged)) = through_zone(&dir, &zone, "d.fam.test:8200", &[]).await else {
        return;
    };
    assert_eq!(
        ids(&merged.snapshot(), Role::Decode),
        ["http://[fd00::81]:8200"]
    );
    zone.set(Answer::NoData, Answer::Silent);
    failed_lookups_keep(&merged, 2, "AAAA timing out beside A without records").await;
    // Both families answer without records: the name has no engines now, no error.
    let errors_before = errors(&merged);
    zone.set(Answer::NoData, Answer::NoData);
    wait_for(&merged, SEEN, "the name without engines", |s| {
        s.by_role(Role::Decode).is_empty()
    })
    .await;
    // At most the lookup under way when the answers changed failed meanwhile.
    assert!(errors(&merged) <= errors_before + 1);
}

/// An SRV target whose AAAA lookup fails (SERVFAIL) while its A lookup answers is
/// resolved as a name is: the new IPv4 engine from the A answer, the target's last good
/// IPv6 engine kept (with its record's weight), an error counted. The failed family
/// does not fail the whole name, which would keep the old IPv4 engine too.
#[tokio::test]
async fn an_srv_targets_family_that_fails_keeps_its_engines_beside_the_other() {
    let dir = TempDir::new("dns-srv-family");
    let zone = Zone::start(Answer::Address(1), Answer::Address(1)).await;
    let srv = ["_fam._tcp.disagg.test,d.fam.test,8201,0,10"];
    let Some((_server, merged)) = through_zone(&dir, &zone, "_fam._tcp.disagg.test", &srv).await
    else {
        return;
    };
    assert_eq!(
        ids(&merged.snapshot(), Role::Decode),
        ["http://127.0.8.1:8201", "http://[fd00::81]:8201"]
    );
    let errors_before = errors(&merged);
    zone.set(Answer::Address(2), Answer::ServFail);
    let set = wait_for(
        &merged,
        SEEN,
        "the new IPv4 engine beside the kept IPv6 one",
        |s| ids(s, Role::Decode) == ["http://127.0.8.2:8201", "http://[fd00::81]:8201"],
    )
    .await;
    assert!(
        set.by_role(Role::Decode).iter().all(|e| e.weight() == 10.0),
        "the record's weight on both"
    );
    eventually(SEEN, "the AAAA SERVFAIL counted", || {
        errors(&merged) > errors_before
    })
    .await;
    // AAAA answers again: the target's IPv6 engine follows it.
    zone.set(Answer::Address(2), Answer::Address(2));
    wait_for(&merged, SEEN, "the new IPv6 engine", |s| {
        ids(s, Role::Decode) == ["http://127.0.8.2:8201", "http://[fd00::82]:8201"]
    })
    .await;
}

/// An address that both families answer, as an A record and IPv4-mapped in an AAAA
/// record (`::ffff:127.0.0.15`), is one engine at its IPv4 address, for a name and an
/// SRV target alike: one endpoint per address, port and role, not two for one socket.
#[tokio::test]
async fn an_address_both_families_answer_is_one_engine() {
    let dir = TempDir::new("dns-both-families");
    let hosts = "127.0.0.15 both.disagg.test\n::ffff:127.0.0.15 both.disagg.test\n";
    let srv = ["_both._tcp.disagg.test,both.disagg.test,8201,0,10"];
    let Some(server) = Dnsmasq::start(&dir, hosts, &srv, 60).await else {
        return;
    };
    let config = config(
        &server,
        vec![
            target("both.disagg.test:8200", Role::Decode),
            target("_both._tcp.disagg.test", Role::Decode),
        ],
    );
    let merged = merged_over(config).await;
    tokio::time::timeout(SEEN, merged.synced())
        .await
        .expect("the names' first list");
    assert_eq!(
        ids(&merged.snapshot(), Role::Decode),
        ["http://127.0.0.15:8200", "http://127.0.0.15:8201"]
    );
    assert_eq!(errors(&merged), 0);
}
