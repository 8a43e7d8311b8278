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

#[test]
fn sglang_names_map_to_the_model_without_transfers() {
    let text = "\
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
    let s = parse(text).unwrap();
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
