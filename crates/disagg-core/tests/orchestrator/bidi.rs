//! vLLM NIXL's bidirectional KV through the orchestrator: a conversation's kept
//! handoff survives an attempt whose prefill leg never reached its engine.

use disagg_connectors::vllm::bidi::{BidiConfig, BidiStore, ConversationKey};

use super::*;

const DECODE_KV: &str = r#"{"do_remote_prefill":false,"do_remote_decode":true,"remote_engine_id":"dec-1","remote_request_id":"r-1","remote_block_ids":[0,1],"remote_host":"localhost","remote_port":5601,"remote_num_tokens":80}"#;

/// A decode's stream ending with its own handoff.
fn decode_with_handoff() -> Reply {
    Reply::sse()
        .frame(ms(0), event(0))
        .frame(
            ms(0),
            format!(r#"data: {{"choices":[],"kv_transfer_params":{DECODE_KV}}}"#) + "\n\n",
        )
        .frame(ms(0), DONE)
}

/// The next turn's first prefill could not be reached: the retry's prefill leg is
/// still sent the conversation's kept handoff, which the refused one never got.
#[tokio::test(start_paused = true)]
async fn a_kept_handoff_outlives_a_prefill_that_refused_the_connection() {
    let fake = Fake::new();
    let mut bidi = BidiConfig::default();
    bidi.key = ConversationKey::Header(http::HeaderName::from_static("x-session-id"));
    let store = BidiStore::new(bidi);
    // Turn 1 on P1 (kept from D1's answer); turn 2 on P2, refused, then retried on P1.
    fake.on(P1, CHAT, prefill_answer());
    fake.on(P1, CHAT, prefill_answer());
    fake.on(P2, CHAT, Reply::refuse());
    fake.always(D1, CHAT, decode_with_handoff());
    let source = StaticSource::new(endpoints(&[P1, P2], &[D1]));
    let mut retry = RetryPolicy::default();
    retry.max_retries = 1;
    let orch = Orchestrator::builder(
        source,
        fake.clone(),
        VllmNixl::new().with_bidirectional(Arc::clone(&store)),
    )
    .retry(Backoff::new(retry))
    .build();
    let turn = |orch: &Orchestrator| {
        let mut req = chat_with(orch, &[("x-session-id", "s1")]);
        req.set_received(std::time::Instant::now(), Some(Arc::from("client-a")));
        req
    };
    for _ in 0..2 {
        let mut body = serve(&orch, turn(&orch)).await.unwrap().into_body();
        while let Some(frame) = next(&mut body).await {
            frame.unwrap();
        }
    }
    assert_eq!(fake.calls_to(P2).len(), 1, "turn 2 went to P2 first");
    let sent = fake.calls_to(P1)[1].json();
    assert_eq!(
        sent["kv_transfer_params"]["remote_engine_id"], "dec-1",
        "{sent}"
    );
    let st = store.stats();
    assert_eq!((st.reused, st.captured), (1, 2), "{st:?}");
    assert_settled(&orch);
}
