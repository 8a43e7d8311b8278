//! Unit tests of `serve`.

use super::*;
use disagg_pairing::KvProfile;
use std::time::Duration;

#[test]
fn the_lmcache_socket_defaults_to_the_listen_host() {
    let args = |notify: Option<&str>| LmcacheArgs {
        lmcache_notify: notify.map(str::to_owned),
        lmcache_receivers: Vec::new(),
        lmcache_notify_ttl: None,
    };
    let local: SocketAddr = "127.0.0.1:8000".parse().unwrap();
    assert_eq!(notify_address(&args(None), local), "127.0.0.1:7500");
    let v6: SocketAddr = "[::1]:8000".parse().unwrap();
    assert_eq!(notify_address(&args(None), v6), "[::1]:7500");
    assert_eq!(
        notify_address(&args(Some("tcp://*:7600")), local),
        "tcp://*:7600"
    );
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn prefill_values_group_as_sglang_writes_them() {
    let v = strings(&[
        "http://p1:30000",
        "8998",
        "http://p2:30000",
        "none",
        "http://p3:1",
    ]);
    assert_eq!(
        parse_prefills(&v).unwrap(),
        [
            ("http://p1:30000", Some(8998)),
            ("http://p2:30000", None),
            ("http://p3:1", None),
        ]
    );
    assert!(parse_prefills(&strings(&["8998"])).is_err());
    assert!(parse_prefills(&strings(&["http://p:1", "1", "2"])).is_err());
    assert!(parse_prefills(&strings(&["http://p:1", "port"])).is_err());
}

#[test]
fn rank_ranges_expand_and_base_urls_drop_ranks() {
    let max = disagg_discovery::DEFAULT_MAX_DP_RANKS;
    assert_eq!(expand_ranks("http://d:1", max).unwrap(), ["http://d:1"]);
    assert_eq!(expand_ranks("http://d:1@2", max).unwrap(), ["http://d:1@2"]);
    assert_eq!(
        expand_ranks("http://d:1@1-3", max).unwrap(),
        ["http://d:1@1", "http://d:1@2", "http://d:1@3"]
    );
    assert!(expand_ranks("http://d:1@3-1", max).is_err());
    assert!(expand_ranks("http://d:1@a-b", max).is_err());
    // Counted, not expanded: 2^32 URLs would never be made.
    let err = expand_ranks("http://d:1@0-4294967295", max).unwrap_err();
    assert!(err.to_string().contains("--max-dp-ranks"), "{err}");
    assert_eq!(expand_ranks("http://d:1@0-1023", max).unwrap().len(), 1024);
    assert!(expand_ranks("http://d:1@0-3", 2).is_err());
    // One rank past the ceiling is a group past it.
    let err = expand_ranks("http://d:1@60000", max).unwrap_err();
    assert!(err.to_string().contains("--max-dp-ranks"), "{err}");
    assert!(expand_ranks("http://d:1@1020-1024", max).is_err());
    assert_eq!(
        expand_ranks("http://d:1@1023", max).unwrap(),
        ["http://d:1@1023"]
    );
    assert_eq!(base_url("http://d:1/@0-3"), "http://d:1");
    assert_eq!(base_url("http://d:1@2"), "http://d:1");
    assert_eq!(base_url("http://d:1/"), "http://d:1");
}

#[test]
fn served_models_parse() {
    assert_eq!(
        parse_models("http://d:1/=llama, qwen").unwrap(),
        (
            "http://d:1".to_owned(),
            vec!["llama".to_owned(), "qwen".to_owned()]
        )
    );
    assert!(parse_models("http://d:1=").is_err());
    assert!(parse_models("llama").is_err());
    // The ceilings of every source's models: 256 distinct names of at most 512 bytes.
    let names: Vec<String> = (0..=256).map(|i| format!("m{i}")).collect();
    let err = parse_models(&format!("http://d:1={}", names.join(","))).unwrap_err();
    assert!(err.contains("256"), "{err}");
    let err = parse_models(&format!("http://d:1=llama,{}", "x".repeat(513))).unwrap_err();
    assert!(err.contains("512"), "{err}");
    assert_eq!(
        parse_models(&format!("http://d:1={}", names[..256].join(",")))
            .unwrap()
            .1
            .len(),
        256
    );
    assert_eq!(
        parse_models("http://d:1=llama,llama,qwen").unwrap().1,
        ["llama", "qwen"]
    );
}

#[test]
fn profiles_parse_with_optional_parts() {
    let (url, p) = parse_profile("http://p:8100/=NixlConnector,kv_producer,8").unwrap();
    assert_eq!(url, "http://p:8100");
    assert_eq!(p.connector.as_deref(), Some("NixlConnector"));
    assert_eq!(p.role, Some(disagg_pairing::KvRole::Producer));
    assert_eq!(p.tp_size, Some(8));
    let (_, p) = parse_profile("http://d:1=,,4").unwrap();
    assert_eq!(
        p,
        KvProfile {
            tp_size: Some(4),
            ..KvProfile::default()
        }
    );
    assert!(parse_profile("http://d:1=,kv_what,").is_err());
    assert!(parse_profile("http://d:1=,,0").is_err());
    assert!(parse_profile("no-equals").is_err());
}

/// The error with which `serve` refuses to start with `args` (after the program
/// name), before it binds or spawns anything.
fn refused_start<const N: usize>(args: [&str; N]) -> String {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let cli = Cli::try_parse_from(std::iter::once("x").chain(args)).unwrap();
    Shared::from_args(&cli.serve, None, tokio::sync::watch::channel(false).1)
        .err()
        .expect("refused")
        .to_string()
}

#[test]
fn a_pair_that_cannot_hand_over_stops_the_proxy() {
    let err = refused_start([
        "--connector",
        "sglang",
        "--prefill",
        "http://127.0.0.1:1",
        "8998",
        "--decode",
        "http://127.0.0.1:2",
        "--kv-profile",
        "http://127.0.0.1:2=NixlConnector,,",
    ]);
    assert!(
        err.contains("http://127.0.0.1:1") && err.contains("http://127.0.0.1:2"),
        "{err}"
    );
    assert!(
        err.contains("NixlConnector") && err.contains("sglang"),
        "{err}"
    );
}

#[test]
fn a_metadata_address_on_the_command_line_stops_the_proxy() {
    for url in [
        "http://169.254.169.254",
        "http://[::ffff:169.254.169.254]:80",
    ] {
        let err = refused_start(["--prefill", "http://127.0.0.1:1", "--decode", url]);
        assert!(
            err.contains("metadata") && err.contains("--allow-link-local-engines"),
            "{err}"
        );
    }
}

#[test]
fn kv_events_without_a_tokenizer_stops_the_proxy() {
    let err = refused_start([
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
        "--prefill-policy",
        "kv_events",
        "--kv-events-port",
        "5557",
    ]);
    assert!(
        err.contains("--tokenizer") && err.contains("--tokenize engine"),
        "{err}"
    );
}

#[test]
fn kv_events_flags_without_the_policy_stop_the_proxy() {
    let err = refused_start([
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
        "--kv-events-port",
        "5557",
    ]);
    assert!(
        err.contains("--kv-events-port") && err.contains("kv_events"),
        "{err}"
    );
}

#[test]
fn max_connections_is_a_count_of_at_least_one() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let parse = |extra: &[&str]| {
        let args = [
            "x",
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
        ];
        Cli::try_parse_from(args.iter().chain(extra))
    };
    let default = parse(&[]).unwrap().serve.max_connections;
    assert_eq!(default, disagg_http::server::DEFAULT_MAX_CONNECTIONS);
    let set = parse(&["--max-connections", "64"])
        .unwrap()
        .serve
        .max_connections;
    assert_eq!(set, 64);
    let err = parse(&["--max-connections", "0"])
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("at least 1"), "{err}");
}

/// Whether `serve` gets past its start-up checks with `args` (after the program name):
/// the shared parts are built (engines unreachable are not contacted further).
fn starts<const N: usize>(args: [&str; N]) -> Result<(), String> {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let cli = Cli::try_parse_from(std::iter::once("x").chain(args)).map_err(|e| e.to_string())?;
    Shared::from_args(&cli.serve, None, tokio::sync::watch::channel(false).1)
        .map(drop)
        .map_err(|e| e.to_string())
}

#[test]
fn decode_only_starts_without_a_prefill_engine() {
    // `--prefill-failure decode-only` serves a request with no prefill endpoint on a
    // decode alone, none configured included, as its hidden alias always did.
    starts([
        "--decode",
        "http://127.0.0.1:2",
        "--prefill-failure",
        "decode-only",
    ])
    .expect("decode-only starts with no prefill engine");
    starts(["--decode", "http://127.0.0.1:2", "--decode-only-fallback"])
        .expect("the hidden alias starts too");
    // Under `fail` there is nothing to serve a request with.
    let err = refused_start(["--decode", "http://127.0.0.1:2"]);
    assert!(err.contains("no prefill engine"), "{err}");
}

/// The engines every start-up check below is given.
const PD: [&str; 4] = [
    "--prefill",
    "http://127.0.0.1:1",
    "--decode",
    "http://127.0.0.1:2",
];

#[test]
fn every_time_flag_is_checked_whether_or_not_its_feature_is_on() {
    // None of these flags' features is on: no DNS target, no discovery, another
    // connector than LMCache, no --bidirectional-kv, no encoder, no engine telemetry.
    let flags = [
        "--dns-refresh",
        "--discovery-sync-timeout",
        "--lmcache-notify-ttl",
        "--decoder-kv-blocks-ttl",
        "--encode-timeout",
        "--engine-metrics-timeout",
        "--drain-timeout",
        "--client-send-timeout",
        "--deadline",
        "--tokenize-timeout",
        "--health-check-timeout",
    ];
    for flag in flags {
        for value in ["-5", "nan", "1e300"] {
            let arg = format!("{flag}={value}");
            let [p, pu, d, du] = PD;
            let err = refused_start([p, pu, d, du, "--engine-metrics-interval", "0", &arg]);
            assert!(err.contains(flag), "{arg}: {err}");
        }
    }
    // The audit's trigger, all at once.
    let [p, pu, d, du] = PD;
    let err = refused_start([
        p,
        pu,
        d,
        du,
        "--dns-refresh=-5",
        "--encode-timeout",
        "nan",
        "--decoder-kv-blocks-ttl",
        "1e300",
    ]);
    assert!(err.contains("--"), "{err}");
    // Valid values still start.
    starts([p, pu, d, du, "--dns-refresh", "5", "--encode-timeout", "0"]).expect("valid");
}

/// The Kubernetes client's bounds are checked at start, before discovery is built:
/// 0 is refused with a message naming the flag.
#[test]
fn k8s_bound_flags_are_checked_at_start() {
    for flag in [
        "--k8s-read-timeout=0",
        "--k8s-request-timeout=0",
        "--k8s-max-response-bytes=0",
        "--k8s-page-size=0",
    ] {
        let [p, pu, d, du] = PD;
        let err = refused_start([p, pu, d, du, "--k8s-decode-selector", "app=vllm", flag]);
        let name = flag.split('=').next().unwrap_or(flag);
        assert!(err.contains(name), "{flag}: {err}");
    }
}

#[test]
fn the_receipt_threshold_is_a_ratio_whether_or_not_telemetry_runs() {
    for value in ["1.5", "-0.1", "nan"] {
        let [p, pu, d, du] = PD;
        let arg = format!("--receipt-threshold={value}");
        let err = refused_start([p, pu, d, du, "--engine-metrics-interval", "0", &arg]);
        assert!(err.contains("--receipt-threshold"), "{arg}: {err}");
    }
    let [p, pu, d, du] = PD;
    starts([
        p,
        pu,
        d,
        du,
        "--engine-metrics-interval",
        "0",
        "--receipt-threshold",
        "1",
    ])
    .expect("1 is a ratio");
}

#[test]
fn a_per_engine_flag_given_twice_for_one_engine_stops_the_proxy() {
    let [p, pu, d, du] = PD;
    // Each flag twice for the decode engine, the second time with a trailing `/`: the
    // proxy takes both for the same engine.
    let cases: [(&str, &str, &str); 7] = [
        (
            "--served-model",
            "http://127.0.0.1:2=a",
            "http://127.0.0.1:2/=b",
        ),
        (
            "--kv-profile",
            "http://127.0.0.1:2=,,1",
            "http://127.0.0.1:2/=,,2",
        ),
        (
            "--ec-profile",
            "http://127.0.0.1:2=example,ec_consumer",
            "http://127.0.0.1:2/=example,ec_both",
        ),
        (
            "--lmcache-receiver",
            "http://127.0.0.1:2=127.0.0.1:7300:7400",
            "http://127.0.0.1:2/@0=127.0.0.1:7301:7401",
        ),
        (
            "--ec-address",
            "http://127.0.0.1:2=127.0.0.1:14579",
            "http://127.0.0.1:2/=127.0.0.1:14580",
        ),
        ("--weight", "http://127.0.0.1:2=1", "http://127.0.0.1:2/=3"),
        (
            "--kv-events-endpoint",
            "http://127.0.0.1:2=tcp://127.0.0.1:5557",
            "http://127.0.0.1:2/=tcp://127.0.0.1:5558",
        ),
    ];
    for (flag, first, second) in cases {
        let err = refused_start([p, pu, d, du, flag, first, flag, second]);
        assert!(
            err.contains(flag) && err.contains("http://127.0.0.1:2") && err.contains("twice"),
            "{flag}: {err}"
        );
    }
    let err = refused_start([
        p,
        pu,
        d,
        du,
        "--engine-api-key",
        "http://127.0.0.1:2=k1",
        "--engine-api-key",
        "http://127.0.0.1:2/=k2",
    ]);
    assert!(
        err.contains("--engine-api-key")
            && err.contains("http://127.0.0.1:2")
            && err.contains("twice"),
        "{err}"
    );
    assert!(
        !err.contains("k1") && !err.contains("k2"),
        "a key is never shown: {err}"
    );
    let err = refused_start([
        p,
        pu,
        d,
        du,
        "--engine-api-key",
        "k1",
        "--engine-api-key",
        "k2",
    ]);
    assert!(
        err.contains("--engine-api-key") && err.contains("twice"),
        "{err}"
    );
    assert!(
        !err.contains("k1") && !err.contains("k2"),
        "a key is never shown: {err}"
    );
    // One rank's weight and its engine's are two settings, not one given twice.
    starts([
        p,
        pu,
        "--decode",
        "http://127.0.0.1:2@0-1",
        "--weight",
        "http://127.0.0.1:2=2",
        "--weight",
        "http://127.0.0.1:2@1=3",
        "--served-model",
        "http://127.0.0.1:1=a",
        "--served-model",
        "http://127.0.0.1:2=a",
    ])
    .expect("distinct engines and ranks start");
}

/// The flags `args` parse to.
fn parsed<const N: usize>(args: [&str; N]) -> ServeArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    Cli::try_parse_from(std::iter::once("x").chain(args))
        .unwrap()
        .serve
}

/// Unset, `--lmcache-notify-ttl` is `--prefill-timeout` plus `--handoff-timeout` plus
/// 10 s, as its help says: a registration outlives the prefill and the KV-ready wait
/// it is kept through. Given, it is kept as given.
#[test]
fn the_lmcache_ttl_is_the_prefill_and_handoff_budgets_and_10_seconds_unless_given() {
    let ttl = |args: ServeArgs| notify_ttl(&args).unwrap();
    let s = Duration::from_secs_f64;
    // The defaults: 300 + 10 + 10.
    assert_eq!(ttl(parsed([])), s(320.0));
    let (p, h) = ("--prefill-timeout", "--handoff-timeout");
    assert_eq!(ttl(parsed([p, "600", h, "30"])), s(640.0));
    assert_eq!(ttl(parsed([p, "0.5", h, "0.25"])), s(10.75));
    // 0 is a budget of no time (every such step fails at once), not "no limit": the
    // sum stays bounded, 10 s.
    assert_eq!(ttl(parsed([p, "0", h, "0"])), s(10.0));
    // Given: kept, the sum of the budgets included.
    let t = "--lmcache-notify-ttl";
    assert_eq!(ttl(parsed([t, "400"])), s(400.0));
    assert_eq!(ttl(parsed([t, "310"])), s(310.0));
    assert_eq!(ttl(parsed([p, "100", h, "20", t, "120"])), s(120.0));
}

/// A `--lmcache-notify-ttl` shorter than `--prefill-timeout` plus `--handoff-timeout`
/// would evict a request's registration while it still waits within those budgets:
/// refused at start, whatever the connector (as the time flags are), naming the three
/// flags and their values.
#[test]
fn an_lmcache_ttl_below_the_prefill_and_handoff_budgets_stops_the_proxy() {
    let [p, pu, d, du] = PD;
    let t = "--lmcache-notify-ttl";
    for connector in ["nixl", "lmcache"] {
        let err = refused_start([p, pu, d, du, "--connector", connector, t, "120"]);
        for part in [
            "--lmcache-notify-ttl (120 s)",
            "--prefill-timeout (300 s)",
            "--handoff-timeout (10 s)",
            "310 s",
        ] {
            assert!(err.contains(part), "{connector}: {part}: {err}");
        }
    }
    let (pt, ht) = ("--prefill-timeout", "--handoff-timeout");
    let err = refused_start([p, pu, d, du, pt, "100", ht, "20", t, "119.5"]);
    assert!(
        err.contains("--lmcache-notify-ttl (119.5 s)") && err.contains("120 s"),
        "{err}"
    );
    // The sum itself is long enough.
    starts([p, pu, d, du, pt, "100", ht, "20", t, "120"]).expect("the sum is enough");
    starts([p, pu, d, du, pt, "100", ht, "20"]).expect("unset, it is derived");
}
