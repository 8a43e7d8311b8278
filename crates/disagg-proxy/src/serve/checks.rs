//! The checks every `serve` start makes of its flags before anything is built or any
//! engine asked: each time flag (whether or not its feature is on) and each per-engine
//! flag given at most once per engine.

use std::collections::HashSet;

use crate::BoxError;

use super::flags::{ServeArgs, secs};

/// Every flag of `args` checked before anything is built: a value that would be
/// refused once its feature is switched on is refused now, and a per-engine flag given
/// twice for one engine is refused rather than one of its values silently kept.
pub(super) fn check_flags(args: &ServeArgs) -> Result<(), BoxError> {
    check_time_flags(args)?;
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
        ("lmcache-notify-ttl", args.lmcache.lmcache_notify_ttl),
        ("decoder-kv-blocks-ttl", args.bidi.decoder_kv_blocks_ttl),
    ];
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
