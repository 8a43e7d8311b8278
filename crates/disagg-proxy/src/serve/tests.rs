//! Unit tests of `serve`.

use super::*;
use disagg_pairing::KvProfile;

#[test]
fn the_lmcache_socket_defaults_to_the_listen_host() {
    let args = |notify: Option<&str>| LmcacheArgs {
        lmcache_notify: notify.map(str::to_owned),
        lmcache_receivers: Vec::new(),
        lmcache_notify_ttl: 120.0,
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
