use super::*;

const VLLM: &str = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"local_compute\"} 10.0
vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"external_kv_transfer\"} 90.0
vllm:prompt_tokens_by_source_total{engine=\"1\",model_name=\"m\",source=\"external_kv_transfer\"} 10.0
# HELP vllm:prompt_tokens_by_source_created Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_created gauge
vllm:prompt_tokens_by_source_created{engine=\"0\",model_name=\"m\",source=\"local_compute\"} 1.7e+09
# HELP vllm:nixl_num_kv_expired_reqs_total Number of requests that had their KV expire.
# TYPE vllm:nixl_num_kv_expired_reqs_total counter
vllm:nixl_num_kv_expired_reqs_total{engine=\"0\",model_name=\"m\"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25
";

#[test]
fn vllm_names_map_to_the_model_summed_over_engine_indexes() {
    let s = parse(VLLM).unwrap();
    assert_eq!(s.family, Some(EngineFamily::Vllm));
    assert_eq!(s.requests_running, Some(3.0));
    assert_eq!(s.prompt_tokens.local_compute, Some(10.0));
    assert_eq!(s.prompt_tokens.external_kv_transfer, Some(100.0));
    assert_eq!(s.prompt_tokens.local_cache_hit, None);
    assert_eq!(s.kv_expired, Some(3.0));
    assert_eq!(s.kv_cache_usage, Some(0.25));
    assert_eq!(s.kv_transfer_failures, None);
}

const SGLANG: &str = "\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name=\"m\",tp_rank=\"0\"} 4.0
# HELP sglang:realtime_tokens_total Total number of tokens processed.
# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{model_name=\"m\",mode=\"prefill_compute\"} 7.0
sglang:realtime_tokens_total{model_name=\"m\",mode=\"decode\"} 70.0
# HELP sglang:num_transfer_failed_reqs_total The number of transfer failed requests.
# TYPE sglang:num_transfer_failed_reqs_total counter
sglang:num_transfer_failed_reqs_total{model_name=\"m\"} 2.0
";

#[test]
fn sglang_names_map_to_the_model_without_transfers() {
    let s = parse(SGLANG).unwrap();
    assert_eq!(s.family, Some(EngineFamily::Sglang));
    assert_eq!(s.requests_waiting, Some(4.0));
    assert_eq!(s.prompt_tokens.local_compute, Some(7.0));
    assert_eq!(s.prompt_tokens.external_kv_transfer, None);
    assert_eq!(s.kv_transfer_failures, Some(2.0));
}

#[test]
fn garbage_is_a_parse_error() {
    let e = parse("{\"not\": \"prometheus\"} <html> = = =\n").unwrap_err();
    assert!(matches!(e, ScrapeError::Parse(_)), "{e:?}");
}

#[test]
fn label_values_with_escapes_and_braces_parse() {
    let text = "# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{model_name=\"a\\\"b}c\",engine=\"0\"} 5\n";
    assert_eq!(parse(text).unwrap().requests_waiting, Some(5.0));
}

fn decode_state() -> EngineState {
    EngineState::new(
        "http://d:1".into(),
        vec![Arc::new(Endpoint::new("http://d:1", Role::Decode).unwrap())],
    )
}

fn tokens(local: f64, external: f64) -> EngineSnapshot {
    EngineSnapshot {
        family: Some(EngineFamily::Vllm),
        prompt_tokens: PromptTokens {
            local_compute: Some(local),
            local_cache_hit: Some(0.0),
            external_kv_transfer: Some(external),
        },
        ..EngineSnapshot::default()
    }
}

#[test]
fn receipts_are_judged_only_in_windows_with_handoffs_and_flag_after_n_low_windows() {
    let config = TelemetryConfig {
        suspect_windows: 2,
        suspect_action: SuspectAction::Eject,
        ..TelemetryConfig::default()
    };
    let t = Telemetry::new(config, None);
    let h = Arc::new(Handoffs::default());
    let mut s = decode_state();
    assert!(!t.judge(&mut s, tokens(0.0, 0.0), Some(Arc::clone(&h))));
    // A healthy window: all 100 tokens arrived.
    h.count.fetch_add(2, Ordering::Relaxed);
    assert!(!t.judge(&mut s, tokens(0.0, 100.0), Some(Arc::clone(&h))));
    assert_eq!(s.ratio, Some(1.0));
    // No handoff in the window: nothing to judge, even though prompts were computed.
    assert!(!t.judge(&mut s, tokens(50.0, 100.0), Some(Arc::clone(&h))));
    assert_eq!(s.ratio, None);
    // Two low windows flag it; with eject, the second asks for the ejection.
    h.count.fetch_add(1, Ordering::Relaxed);
    assert!(!t.judge(&mut s, tokens(100.0, 100.0), Some(Arc::clone(&h))));
    assert_eq!(s.ratio, Some(0.0));
    assert!(!s.suspect);
    h.count.fetch_add(1, Ordering::Relaxed);
    assert!(t.judge(&mut s, tokens(150.0, 110.0), Some(Arc::clone(&h))));
    assert!(s.suspect);
    // A good window clears it.
    h.count.fetch_add(1, Ordering::Relaxed);
    assert!(!t.judge(&mut s, tokens(150.0, 200.0), Some(Arc::clone(&h))));
    assert!(!s.suspect);
}

#[test]
fn an_engines_requests_are_its_waiting_and_running_when_it_counts_either() {
    // Running only (3 over two engine indexes), no waiting series.
    assert_eq!(parse(VLLM).unwrap().requests(), Some(3));
    let mut s = EngineSnapshot {
        requests_waiting: Some(4.0),
        requests_running: Some(2.4),
        ..EngineSnapshot::default()
    };
    assert_eq!(s.requests(), Some(6));
    // Nonsense counts weigh nothing; a huge one is bounded, not wrapped.
    s.requests_waiting = Some(f64::NAN);
    s.requests_running = Some(-5.0);
    assert_eq!(s.requests(), Some(0));
    s.requests_waiting = Some(1e30);
    assert_eq!(s.requests(), Some(u64::MAX));
    assert_eq!(EngineSnapshot::default().requests(), None);
}

/// The snapshot as read before the filter: the parser on the whole text.
fn unfiltered(text: &str) -> Result<EngineSnapshot, String> {
    let (metrics, errors) = prom_text_format_parser::parse_scrape(text);
    match errors {
        Some(e) if metrics.is_empty() => Err(format!("{e:?}")),
        _ => Ok(names::snapshot(&metrics)),
    }
}

/// `parse` gives what the parser on the whole text gave: the same snapshot, or an
/// error for the same text.
/// Whether it was a snapshot.
#[track_caller]
fn same_as_unfiltered(text: &str) -> bool {
    match (parse(text), unfiltered(text)) {
        (Ok(filtered), Ok(whole)) => {
            assert_eq!(filtered, whole, "{text:?}");
            true
        }
        (Err(ScrapeError::Parse(_)), Err(_)) => false,
        (filtered, whole) => panic!("{text:?}: {filtered:?}, before {whole:?}"),
    }
}

/// A vLLM engine's `/metrics` as it writes it: process and Python collectors, info
/// gauges, histograms, `_created` series, two data-parallel engines.
const VLLM_FULL: &str = "\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation=\"0\"} 12012.0
python_gc_objects_collected_total{generation=\"1\"} 1645.0
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation=\"CPython\",major=\"3\",minor=\"12\",patchlevel=\"9\",version=\"3.12.9\"} 1.0
# HELP process_virtual_memory_bytes Virtual memory size in bytes.
# TYPE process_virtual_memory_bytes gauge
process_virtual_memory_bytes 2.6537947136e+010
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 3.0
vllm:num_requests_running{engine=\"1\",model_name=\"Qwen/Qwen3-8B\"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 1.0
vllm:num_requests_waiting{engine=\"1\",model_name=\"Qwen/Qwen3-8B\"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 0.125
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"Qwen/Qwen3-8B\"} 0.0625
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 4096.0
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\",source=\"local_compute\"} 1200.0
vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\",source=\"local_cache_hit\"} 300.0
vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\",source=\"external_kv_transfer\"} 2500.0
vllm:prompt_tokens_by_source_total{engine=\"1\",model_name=\"Qwen/Qwen3-8B\",source=\"local_compute\"} 800.0
vllm:prompt_tokens_by_source_total{engine=\"1\",model_name=\"Qwen/Qwen3-8B\",source=\"local_cache_hit\"} 0.0
vllm:prompt_tokens_by_source_total{engine=\"1\",model_name=\"Qwen/Qwen3-8B\",source=\"external_kv_transfer\"} 1500.0
# HELP vllm:prompt_tokens_by_source_created Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_created gauge
vllm:prompt_tokens_by_source_created{engine=\"0\",model_name=\"Qwen/Qwen3-8B\",source=\"local_compute\"} 1.7526e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 3.25
vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.001\",model_name=\"Qwen/Qwen3-8B\"} 0.0
vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.5\",model_name=\"Qwen/Qwen3-8B\"} 9.0
vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"Qwen/Qwen3-8B\"} 10.0
vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 10.0
# HELP vllm:nixl_num_failed_transfers_total Number of failed NIXL KV Cache transfers.
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 1.0
# HELP vllm:nixl_num_kv_expired_reqs_total Number of requests that had their KV expire.
# TYPE vllm:nixl_num_kv_expired_reqs_total counter
vllm:nixl_num_kv_expired_reqs_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 4.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\"} 1.0
";

/// SGLang's, with a histogram in front of the names read.
const SGLANG_FULL: &str = "\
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le=\"0.1\",model_name=\"m\"} 1.0
sglang:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"m\"} 2.0
sglang:time_to_first_token_seconds_count{model_name=\"m\"} 2.0
sglang:time_to_first_token_seconds_sum{model_name=\"m\"} 0.3
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name=\"m\",pp_rank=\"0\",tp_rank=\"0\"} 6.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name=\"m\",pp_rank=\"0\",tp_rank=\"0\"} 0.5
";

#[test]
fn engines_texts_read_as_they_did_from_the_whole_text() {
    let sglang = format!("{SGLANG_FULL}{SGLANG}");
    for text in [VLLM, SGLANG, VLLM_FULL, SGLANG_FULL, sglang.as_str()] {
        same_as_unfiltered(text);
    }
    let s = parse(VLLM_FULL).unwrap();
    assert_eq!(s.family, Some(EngineFamily::Vllm));
    assert_eq!(s.requests_running, Some(5.0));
    assert_eq!(s.requests_waiting, Some(1.0));
    assert_eq!(s.kv_cache_usage, Some(0.1875));
    assert_eq!(
        s.prompt_tokens,
        PromptTokens {
            local_compute: Some(2000.0),
            local_cache_hit: Some(300.0),
            external_kv_transfer: Some(4000.0),
        }
    );
    assert_eq!(s.kv_transfer_failures, Some(1.0));
    assert_eq!(s.kv_expired, Some(4.0));
    let s = parse(&sglang).unwrap();
    assert_eq!(s.family, Some(EngineFamily::Sglang));
    assert_eq!(
        (s.requests_running, s.requests_waiting),
        (Some(6.0), Some(4.0))
    );
    assert_eq!(s.kv_cache_usage, Some(0.5));
    // Only the lines of the names read reach the parser.
    let kept = filter::filter(VLLM_FULL).unwrap();
    assert!(!kept.text.contains("python_") && !kept.text.contains("_seconds"));
    // Six metrics' HELP and TYPE, their 14 samples, and a break for each of the three
    // runs of metrics dropped before one read.
    assert_eq!(kept.text.lines().count(), 2 * 6 + 14 + 3);
    assert_eq!(kept.text.matches(filter::BREAK).count(), 3);
}

/// `unit` repeated to `size` bytes.
fn repeated(unit: &str, size: usize) -> String {
    unit.repeat(size / unit.len())
}

#[test]
fn four_mib_of_lines_not_read_reach_the_parser_as_nothing() {
    const SIZE: usize = 4 << 20;
    let junk = [
        "\n",
        "# a comment about nothing the telemetry reads\n",
        "python_gc_objects_collected_total{generation=\"0\"} 12012.0\n",
        "# HELP foo_seconds A.\n# TYPE foo_seconds histogram\nfoo_seconds_bucket{le=\"+Inf\"} 1\n\n",
    ];
    for unit in junk {
        // Before: the parser on the whole text, at a size it reads quickly.
        let small = repeated(unit, 64 << 10);
        same_as_unfiltered(&small);
        assert_eq!(parse(&small).unwrap(), EngineSnapshot::default());
        let text = repeated(unit, SIZE);
        assert_eq!(filter::filter(&text).unwrap().text, "", "{unit:?}");
        assert_eq!(parse(&text).unwrap(), EngineSnapshot::default(), "{unit:?}");
        // With an engine's metrics among them, only those are kept.
        let around = repeated(unit, 1 << 20);
        let text = format!("{around}{VLLM}{around}");
        let kept = filter::filter(&text).unwrap();
        assert!(
            kept.text.len() < VLLM.len(),
            "{unit:?}: {}",
            kept.text.len()
        );
        assert_eq!(parse(&text).unwrap(), parse(VLLM).unwrap(), "{unit:?}");
    }
    // Not the text format, however deep in the body: still refused.
    let text = format!("{}<html>\n", repeated("\n", SIZE));
    assert!(matches!(parse(&text), Err(ScrapeError::Parse(_))));
    let text = format!("{}<html>\n{VLLM}", repeated("# c\n", 1 << 20));
    assert!(matches!(parse(&text), Err(ScrapeError::Parse(_))));
}

#[test]
fn lines_of_the_names_read_have_a_ceiling() {
    let line = "vllm:num_requests_running{engine=\"0\"} 1\n";
    let text = line.repeat(filter::MAX_KEPT_LINES);
    assert_eq!(
        parse(&text).unwrap().requests_running,
        Some(filter::MAX_KEPT_LINES as f64)
    );
    let text = line.repeat(filter::MAX_KEPT_LINES + 1);
    assert!(matches!(parse(&text), Err(ScrapeError::Ceiling(_))));
    // Fewer lines, but more bytes than kept.
    let long = format!(
        "vllm:num_requests_running{{info=\"{}\"}} 1\n",
        "x".repeat(2000)
    );
    assert!(long.len() * 1100 > filter::MAX_KEPT_BYTES);
    assert!(matches!(
        parse(&long.repeat(1100)),
        Err(ScrapeError::Ceiling(_))
    ));
    assert_eq!(
        parse(&long.repeat(400)).unwrap().requests_running,
        Some(400.0)
    );
    // A sample line of one-letter labels, read or not, over 64 KiB: never parsed.
    for name in ["vllm:num_requests_running", "foo"] {
        let labels = vec!["a=\"\""; filter::MAX_SAMPLE_LINE / 5].join(",");
        let text = format!("{name}{{{labels}}} 1\n");
        assert!(
            matches!(parse(&text), Err(ScrapeError::Ceiling(_))),
            "{name}"
        );
        let labels = vec!["a=\"\""; 1000].join(",");
        same_as_unfiltered(&format!("{name}{{{labels}}} 1\n"));
    }
    // The kept text is one allocation of the body's size at most, even where every
    // other line is dropped and stands as a break.
    let text = "vllm:num_requests_running 1\na+1\n".repeat(1000);
    let kept = filter::filter(&text).unwrap();
    assert!(kept.text.len() <= text.len());
    assert_eq!(
        kept.text.capacity(),
        String::with_capacity(text.len()).capacity()
    );
    same_as_unfiltered(&text);
}

/// The kept text was allocated at the body's size, up to `--engine-metrics-max-bytes`
/// at every scrape, though no more than `MAX_KEPT_BYTES` of it is ever kept.
#[test]
fn the_kept_text_is_allocated_at_its_ceiling_at_most() {
    // Metrics read, just under the ceiling, then 2 MiB of blank lines.
    let long = format!(
        "vllm:num_requests_running{{info=\"{}\"}} 1\n",
        "x".repeat(2000)
    );
    let read = long.repeat(filter::MAX_KEPT_BYTES / long.len());
    let text = format!("{read}{}", repeated("\n", 2 << 20));
    assert!(text.len() > 2 * filter::MAX_KEPT_BYTES - long.len());
    let kept = filter::filter(&text).unwrap();
    assert_eq!(kept.text, read);
    // One allocation, at the ceiling, never grown.
    assert_eq!(
        kept.text.capacity(),
        String::with_capacity(filter::MAX_KEPT_BYTES).capacity()
    );
    // A smaller body: at its size.
    let text = format!("{}{VLLM}", repeated("\n", 1 << 20));
    let kept = filter::filter(&text).unwrap();
    assert_eq!(
        kept.text.capacity(),
        String::with_capacity(text.len()).capacity()
    );
}

/// Lines of every kind the parser tells apart, some not the format.
const FRAGMENTS: &[&str] = &[
    "",
    "   ",
    "\t",
    "# a comment",
    "#",
    "# ",
    "# HELP foo",
    "# HELP foo a help",
    "# HELP vllm:num_requests_running Running.",
    "#HELPvllm:num_requests_running x",
    "# TYPE vllm:num_requests_running gauge",
    "# TYPE vllm:num_requests_running histogram",
    "# TYPE vllm:num_requests_running summary",
    "# TYPE vllm:num_requests_running gauge ",
    "# TYPE vllm:num_requests_running bogus",
    "# TYPE foo counter",
    "# TYPE foo histogram",
    "# HELP sglang:token_usage u",
    "vllm:num_requests_running 1",
    "vllm:num_requests_running{engine=\"0\"} 2",
    "vllm:num_requests_running_sum 5",
    "vllm:num_requests_running_count 3",
    "vllm:num_requests_running_bucket{le=\"+Inf\"} 7",
    "vllm:num_requests_waiting 4 1700000000000",
    "vllm:kv_cache_usage_perc{a=\"x}y\",b=\"q\\\"r\"} 0.5",
    "vllm:kv_cache_usage_perc{a=\"line\nbreak\"} 0.25",
    "vllm:prompt_tokens_by_source_total{source=\"local_compute\"} 10",
    "vllm:prompt_tokens_by_source_total{source=\"external_kv_transfer\"} 5",
    "sglang:num_queue_reqs 2",
    "sglang:realtime_tokens_total{mode=\"prefill_cache\"} 9",
    "vllm:other_metric 1",
    "vllm:other_metric_total{x=\"1\"} NaN",
    "sglang:other 1",
    "foo 1",
    "foo_bucket{le=\"1\"} 1",
    "foo_sum 2",
    "a+1",
    "a.5",
    "_ 0",
    " foo 1",
    "foo",
    "vllm:num_requests_running",
    "vllm:num_requests_running{a=\"b\" 1",
    "{\"not\": \"prometheus\"}",
    "<html>",
    "vllm:num_requests_running 1\r",
    "foo{a=\"\\x\"} 1",
    "vllm:num_requests_running +Inf",
    "vllm:num_requests_running -3e2",
];

#[test]
fn any_mix_of_lines_reads_as_the_whole_text_did() {
    // A fixed xorshift: the same texts every run.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let (mut read, mut refused) = (0, 0);
    for _ in 0..20_000 {
        let lines: Vec<&str> = (0..next(10))
            .map(|_| FRAGMENTS[next(FRAGMENTS.len())])
            .collect();
        let mut text = lines.join("\n");
        if next(2) == 0 {
            text.push('\n');
        }
        if same_as_unfiltered(&text) {
            read += 1;
        } else {
            refused += 1;
        }
    }
    // Both outcomes were compared, many times.
    assert!(
        read > 5_000 && refused > 5_000,
        "{read} read, {refused} refused"
    );
    // Cases the mix may miss: a read metric split by others (the last group is read),
    // a read name typed as a summary, a family seen only in names not read.
    for text in [
        "vllm:num_requests_running 1\nfoo 2\nvllm:num_requests_running 3\n",
        "vllm:num_requests_running 1\n# HELP foo x\nvllm:num_requests_running 3\n",
        "vllm:num_requests_running 1\n# c\n\nvllm:num_requests_running 3\n",
        "# TYPE vllm:num_requests_running summary\nvllm:num_requests_running_sum 5\n",
        "# TYPE vllm:num_requests_running summary\n# TYPE foo gauge\nvllm:num_requests_running_sum 5\n",
        "# HELP vllm:num_requests_running x\n# HELP foo y\n# TYPE vllm:num_requests_running histogram\nvllm:num_requests_running_sum 5\n",
        "vllm:other_metric 1\n",
        "foo 1\nsglang:other 1\nvllm:num_requests_running 2",
        "# HELP foo x\n",
        "# HELP foo\n",
        "",
        "\n",
    ] {
        same_as_unfiltered(text);
    }
}

/// Finite samples summing past `f64::MAX` made an infinite count, the next
/// window's delta infinity less infinity, a NaN: judged as a low ratio, exported as NaN,
/// and with eject, the decode ejected.
#[test]
fn counts_that_overflow_or_go_negative_are_not_judged() {
    let config = TelemetryConfig {
        suspect_windows: 2,
        suspect_action: SuspectAction::Eject,
        ..TelemetryConfig::default()
    };
    let t = Telemetry::new(config, None);
    let h = Arc::new(Handoffs::default());
    let mut s = decode_state();
    assert!(!t.judge(&mut s, tokens(0.0, 0.0), Some(Arc::clone(&h))));
    // Two engine indexes of 1e308 external tokens each: the sum is infinite.
    let text = "\
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine=\"0\",source=\"local_compute\"} 0
vllm:prompt_tokens_by_source_total{engine=\"0\",source=\"external_kv_transfer\"} 1e308
vllm:prompt_tokens_by_source_total{engine=\"1\",source=\"external_kv_transfer\"} 1e308
";
    let huge = parse(text).unwrap();
    assert_eq!(huge.prompt_tokens.external_kv_transfer, Some(f64::INFINITY));
    for _ in 0..2 {
        h.count.fetch_add(1, Ordering::Relaxed);
        assert!(!t.judge(&mut s, huge.clone(), Some(Arc::clone(&h))));
        assert_eq!(s.ratio, None);
        assert!(!s.suspect);
    }
    // A negative count makes no share either (it would be a ratio above 1).
    assert!(!t.judge(&mut s, tokens(0.0, 0.0), Some(Arc::clone(&h))));
    h.count.fetch_add(1, Ordering::Relaxed);
    assert!(!t.judge(&mut s, tokens(-50.0, 100.0), Some(Arc::clone(&h))));
    assert_eq!(s.ratio, None);
    // Counts that make a share are judged again.
    assert!(!t.judge(&mut s, tokens(0.0, 0.0), Some(Arc::clone(&h))));
    h.count.fetch_add(1, Ordering::Relaxed);
    assert!(!t.judge(&mut s, tokens(0.0, 100.0), Some(Arc::clone(&h))));
    assert_eq!(s.ratio, Some(1.0));
}

/// An interval of `Duration::MAX` (never) overflowed the clock and panicked.
#[tokio::test(start_paused = true)]
async fn an_interval_of_duration_max_never_scrapes_instead_of_panicking() {
    use futures::FutureExt;

    struct Never;
    impl Transport for Never {
        fn send(&self, _: http::Request<Bytes>) -> disagg_core::transport::ResponseFuture {
            panic!("no scrape within forever")
        }
    }
    let config = TelemetryConfig {
        interval: Duration::MAX,
        ..TelemetryConfig::default()
    };
    let t = Telemetry::new(config, None);
    let source: Arc<dyn EndpointSource> =
        Arc::new(disagg_core::source::StaticSource::new([Endpoint::new(
            "http://d:1",
            Role::Decode,
        )
        .unwrap()]));
    let (_stop_tx, stop) = watch::channel(false);
    let mut run = Box::pin(t.run(source, Never, stop));
    assert!((&mut run).now_or_never().is_none());
    tokio::time::advance(Duration::from_secs(3600)).await;
    assert!((&mut run).now_or_never().is_none());
}
