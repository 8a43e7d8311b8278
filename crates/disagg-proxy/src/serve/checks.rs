//! The checks every `serve` start makes of its flags before anything is built or any
//! engine asked: each time flag (whether or not its feature is on), LMCache's
//! registration TTL against the budgets it must outlive, the Kubernetes client's
//! bounds, and each per-engine flag given at most once per engine.

use std::collections::HashSet;

use crate::BoxError;

use super::flags::{ServeArgs, secs};

/// Every flag of `args` checked before anything is built: a value that would be
/// refused once its feature is switched on is refused now, and a per-engine flag given
/// twice for one engine is refused rather than one of its values silently kept.
pub(super) fn check_flags(args: &ServeArgs) -> Result<(), BoxError> {
    check_time_flags(args)?;
    // LMCache's registrations outlive the budgets they are waited on within, whether or
    // not the connector is LMCache.
    super::connectors::notify_ttl(args)?;
    args.discovery.check_k8s_bounds()?;
    check_once_per_engine(args)
}

/// Every time flag read with [`secs`] (negative, NaN and over 10^9 s refused, naming the
/// flag), and `--receipt-threshold` within 0 to 1, whatever else the flags say.
fn check_time_flags(args: &ServeArgs) -> Result<(), BoxError> {
    let mut flags = vec![
        ("encode-timeout", args.encode_timeout),
        ("prefill-timeout", args.prefill_timeout),
        ("decode-timeout", args.decode_timeout),
        ("connect-timeout", args.connect_timeout),
        ("drain-timeout", args.drain_timeout),
        ("client-send-timeout", args.client_send_timeout),
        ("body-timeout", args.client_body.body_timeout),
        ("decoder-kv-blocks-ttl", args.bidi.decoder_kv_blocks_ttl),
    ];
    flags.extend(
        args.lmcache
            .lmcache_notify_ttl
            .map(|t| ("lmcache-notify-ttl", t)),
    );
    flags.extend(args.reliability.time_flags());
    flags.extend(args.discovery.time_flags());
    flags.extend(args.kv_events.time_flags());
    flags.extend(args.edge.time_flags());
    for (flag, value) in flags {
        secs(value, flag)?;
    }
    args.reliability.check_receipt_threshold()
}

/// Each per-engine flag names an engine at most once. The URLs are compared as the
/// proxy matches them to its engines: as each flag's parser keeps them (without their
/// trailing `/`; `--lmcache-receiver` without `@RANK` too, `--weight` with it, since a
/// rank's weight and its engine's are two settings).
fn check_once_per_engine(args: &ServeArgs) -> Result<(), BoxError> {
    let lists: [(&str, Vec<&str>); 7] = [
        ("--served-model", urls(&args.served_models)),
        ("--kv-profile", urls(&args.kv_profiles)),
        ("--ec-profile", urls(&args.ec_profiles)),
        ("--lmcache-receiver", urls(&args.lmcache.lmcache_receivers)),
        (
            "--ec-address",
            args.ec_addresses
                .iter()
                .map(|(u, _, _)| u.as_str())
                .collect(),
        ),
        ("--weight", urls(&args.weights)),
        (
            "--kv-events-endpoint",
            args.kv_events.endpoint_engines().collect(),
        ),
    ];
    for (flag, urls) in lists {
        if let Some(url) = repeated(urls) {
            let hint = match flag {
                "--served-model" => " (name all its models in one: URL=NAME,NAME)",
                _ => "",
            };
            return Err(
                format!("{flag} is given twice for {url}: give it once per engine{hint}").into(),
            );
        }
    }
    args.edge.check_once_per_engine()
}

/// The URLs of a per-engine flag's values.
fn urls<T>(values: &[(String, T)]) -> Vec<&str> {
    values.iter().map(|(u, _)| u.as_str()).collect()
}

/// The first item of `items` seen before.
pub(crate) fn repeated<'a>(items: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let mut seen = HashSet::new();
    items.into_iter().find(|item| !seen.insert(*item))
}

/// A host the flags make the proxy listen on or connect to, or tell an engine to
/// connect to: what [`ServeArgs::other_addresses`] lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Addressed {
    /// The flag that gives it (`--kv-events-endpoint`).
    pub flag: &'static str,
    /// The host as given (an IPv6 address without its brackets; `*` for every
    /// interface); `None` for a discovery source, whose engines are known only once
    /// it runs, at any host.
    pub host: Option<String>,
}

impl ServeArgs {
    /// Every host these flags address besides `--listen` ([`listen`](Self::listen))
    /// and the engine URLs ([`engine_urls`](Self::engine_urls)): the sockets the
    /// proxy binds or connects to for a connector, KV events or traces, the addresses
    /// it hands the engines to connect to (`--ec-address`, `--lmcache-receiver`), and
    /// the discovery sources, whose engines may be anywhere. A default that follows
    /// `--listen` (`--lmcache-notify` unset) or the engines' hosts
    /// (`--kv-events-port`) adds none. `OTEL_EXPORTER_OTLP_ENDPOINT`, read when
    /// `--otlp-endpoint` is not given, is not a flag and not listed.
    pub fn other_addresses(&self) -> Vec<Addressed> {
        let given = |flag, host: &str| Addressed {
            flag,
            host: Some(host_of(host).to_owned()),
        };
        let mut out = Vec::new();
        if let Some(notify) = &self.lmcache.lmcache_notify {
            out.push(given("--lmcache-notify", notify));
        }
        for (_, receiver) in &self.lmcache.lmcache_receivers {
            out.push(given("--lmcache-receiver", receiver.host()));
        }
        for (_, host, _) in &self.ec_addresses {
            out.push(given("--ec-address", host));
        }
        for address in self.kv_events.addresses() {
            out.push(given("--kv-events-endpoint", address));
        }
        if let Some(url) = self.observe.otlp_endpoint() {
            out.push(given("--otlp-endpoint", url));
        }
        if let Some(server) = self.discovery.dns_server() {
            out.push(Addressed {
                flag: "--dns-server",
                host: Some(server.ip().to_string()),
            });
        }
        for flag in self.discovery.sources_given() {
            out.push(Addressed { flag, host: None });
        }
        out
    }
}

/// The host of `address`: a URL (`http://host:port/path`, `tcp://host:port`), or
/// `host:port`, or a bare host; an IPv6 address without its brackets.
fn host_of(address: &str) -> &str {
    let rest = address.split_once("://").map_or(address, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    match authority.rsplit_once(':') {
        // One colon: `host:port`; more: an IPv6 address without brackets.
        Some((host, _)) if !host.contains(':') => host,
        _ => authority,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn addresses(flags: &[&str]) -> Vec<Addressed> {
        let args = ["x", "--decode", "http://127.0.0.1:2"].into_iter();
        Cli::try_parse_from(args.chain(flags.iter().copied()))
            .unwrap()
            .serve
            .other_addresses()
    }

    fn host(flag: &'static str, host: &str) -> Addressed {
        Addressed {
            flag,
            host: Some(host.to_owned()),
        }
    }

    #[test]
    fn hosts_are_read_from_every_form() {
        for (address, host) in [
            ("http://collector:4318", "collector"),
            ("http://10.0.0.1:4318/base?x#y", "10.0.0.1"),
            ("tcp://*:7500", "*"),
            ("tcp://[::1]:5557", "::1"),
            ("127.0.0.1:7500", "127.0.0.1"),
            ("http://user@10.0.0.2:80", "10.0.0.2"),
            ("fe80::1", "fe80::1"),
            ("engine", "engine"),
        ] {
            assert_eq!(host_of(address), host, "{address}");
        }
    }

    /// Every flag that addresses a host of its own is listed with that host, and each
    /// discovery source with none; the defaults list nothing.
    #[test]
    fn every_other_address_is_listed() {
        assert_eq!(addresses(&[]), []);
        // Defaults that follow --listen or the engines' hosts add none.
        assert_eq!(addresses(&["--kv-events-port", "5557"]), []);
        let listed = addresses(&[
            "--lmcache-notify",
            "tcp://*:7500",
            "--lmcache-receiver",
            "http://127.0.0.1:2=10.0.0.3:7300:7400",
            "--ec-address",
            "http://127.0.0.1:2=10.0.0.4:14579",
            "--kv-events-endpoint",
            "http://127.0.0.1:2=tcp://10.0.0.5:5557",
            "--otlp-endpoint",
            "http://collector:4318",
            "--dns-server",
            "10.0.0.6:53",
            "--decode-dns",
            "engines:8000",
            "--endpoints-file",
            "/e.toml",
            "--k8s-prefill-selector",
            "app=vllm",
        ]);
        assert_eq!(
            listed,
            [
                host("--lmcache-notify", "*"),
                host("--lmcache-receiver", "10.0.0.3"),
                host("--ec-address", "10.0.0.4"),
                host("--kv-events-endpoint", "10.0.0.5"),
                host("--otlp-endpoint", "collector"),
                host("--dns-server", "10.0.0.6"),
                Addressed {
                    flag: "--k8s-prefill-selector",
                    host: None
                },
                Addressed {
                    flag: "--decode-dns",
                    host: None
                },
                Addressed {
                    flag: "--endpoints-file",
                    host: None
                },
            ]
        );
    }
}
