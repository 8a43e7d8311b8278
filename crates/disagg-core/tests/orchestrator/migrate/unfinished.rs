//! A tracked stream that reaches `data: [DONE]` (or its end) before its answer got a
//! finish reason is a broken stream: continued while the migration limit allows it,
//! else ended with the proxy's error event and failed, never told a success.
//!
//! The decodes' streams are vLLM 0.33's for a streamed request whose KV load fails
//! (`kv_load_failure_policy="fail"`, as `disagg-sim` plays it): a chat answers its role
//! chunk, one `{"error": {...}}` event and `[DONE]`; completions answer no chunk of the
//! answer at all (its usage chunk only, when asked for), then `[DONE]`.

use super::traced::Told;
use super::*;

use disagg_core::outcome::Delivery;

/// A chat decode whose KV load failed: its role chunk (the prompt's ids on it), the
/// error event, `[DONE]`.
fn chat_kv_failed() -> Reply {
    Reply::sse()
        .frame(
            ms(0),
            r#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,2,3],"prompt_text":null}"#.to_owned() + "\n\n",
        )
        .frame(
            ms(0),
            r#"data: {"error":{"message":"KV transfer failed: nobody listening","type":"InternalServerError","param":null,"code":500}}"#.to_owned() + "\n\n",
        )
        .frame(ms(0), DONE)
}

/// A completions decode whose KV load failed: no chunk of the answer; its usage chunk
/// (the prompt's tokens, none generated) when `usage`; then `[DONE]`.
fn completion_kv_failed(usage: bool) -> Reply {
    let reply = Reply::sse();
    let reply = if usage {
        reply.frame(ms(0), usage_chunk(3, 0))
    } else {
        reply
    };
    reply.frame(ms(0), DONE)
}

/// A completions usage chunk of `prompt` and `completion` tokens.
fn usage_chunk(prompt: u32, completion: u32) -> String {
    let total = prompt + completion;
    format!(
        r#"data: {{"id":"cmpl-2","object":"text_completion","created":2,"model":"m","choices":[],"usage":{{"prompt_tokens":{prompt},"total_tokens":{total},"completion_tokens":{completion}}}}}"#
    ) + "\n\n"
}

/// A completions continuation's first chunk, "B" (token 8), the prompt's ids on its
/// choice, then "C" (token 9) to its finish; no `[DONE]` yet.
fn from_the_prompt() -> Reply {
    Reply::sse()
        .frame(
            ms(0),
            r#"data: {"id":"cmpl-2","object":"text_completion","created":2,"model":"m","choices":[{"index":0,"text":"B","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[1,2,3],"token_ids":[8]}]}"#.to_owned() + "\n\n",
        )
        .frame(ms(0), continued("C", 9, Some("length")))
}

/// The chat's legs when every decode's KV load fails: P1 prefills the chat and every
/// continuation, D1 answers [`chat_kv_failed`], D2 the continuation
/// [`completion_kv_failed`] with its usage chunk.
fn kv_failing_chat(fake: &Fake) -> &Fake {
    fake.on(P1, CHAT, prefill_answer())
        .always(P1, COMPLETIONS, prefill_answer())
        .on(D1, CHAT, chat_kv_failed())
        .on(D2, COMPLETIONS, completion_kv_failed(true))
}

/// A completions request's legs when its first decode's KV load fails: P1 prefills it
/// (and every continuation), D1 answers [`completion_kv_failed`] (`usage` as there).
fn kv_failing_completion(fake: &Fake, usage: bool) -> &Fake {
    fake.always(P1, COMPLETIONS, prefill_answer())
        .on(D1, COMPLETIONS, completion_kv_failed(usage))
}

/// A healthy chat: P1 prefills it, D1 streams [`first_leg`], then `tail`, then `[DONE]`.
fn healthy<'a>(fake: &'a Fake, tail: &[String]) -> &'a Fake {
    let reply = first_leg()
        .into_iter()
        .chain(tail.iter().cloned())
        .fold(Reply::sse(), |reply, frame| reply.frame(ms(0), frame));
    fake.on(P1, CHAT, prefill_answer())
        .on(D1, CHAT, reply.frame(ms(0), DONE))
}

/// A streamed completions request of the client's (`client`, its JSON body).
fn completion(orch: &Orchestrator, client: &str) -> PdRequest {
    orch.request(
        Api::Completions,
        HeaderMap::new(),
        &Bytes::from(client.to_owned()),
    )
    .unwrap()
}

/// The client's stream for `req`, read to its end (an error frame kept as
/// `<error: …>`): its text, and its events' JSON payloads (`[DONE]` as the string).
async fn streamed(orch: &Orchestrator, req: PdRequest) -> (String, Vec<Value>) {
    let mut body = serve(orch, req).await.unwrap().into_body();
    let mut text = String::new();
    while let Some(frame) = next(&mut body).await {
        match frame {
            Ok(frame) => text.push_str(&frame),
            Err(e) => text.push_str(&format!("<error: {e}>")),
        }
    }
    drop(body);
    let events = text
        .split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .map(|p| serde_json::from_str(p).unwrap_or_else(|_| Value::String(p.to_owned())))
        .collect();
    (text, events)
}

/// The stream ended as an answer does: `[DONE]` last, no error event among `events`.
fn assert_clean_end(events: &[Value], what: &str, text: &str) {
    assert_eq!(events.last(), Some(&json!("[DONE]")), "{what}: {text}");
    assert!(
        events.iter().all(|e| e.get("error").is_none()),
        "{what}: {text}"
    );
}

/// One usage chunk among `events`, counting `prompt` and `completion` tokens.
fn assert_one_usage(events: &[Value], prompt: u32, completion: u32, what: &str, text: &str) {
    let usages: Vec<&Value> = events.iter().filter(|e| e["usage"].is_object()).collect();
    let [usage] = &usages[..] else {
        panic!("{what}: one usage chunk: {text}")
    };
    assert_eq!(
        (
            &usage["usage"]["prompt_tokens"],
            &usage["usage"]["completion_tokens"]
        ),
        (&json!(prompt), &json!(completion)),
        "{what}: {text}"
    );
}

/// A healthy stream ran on its first decode alone: no continuation sent, the request
/// complete with no migration, nothing held.
fn assert_untouched(fake: &Fake, told: &Told, orch: &Orchestrator) {
    assert!(fake.calls_to(D2).is_empty(), "no continuation");
    let summary = told.summary();
    assert_eq!(
        (summary.delivery, summary.migrations),
        (Delivery::Complete, 0)
    );
    assert_settled(orch);
}

/// Every decode's KV load fails, migration allowed once: the chat's first leg sends the
/// error event, its continuation (a completions request) fails its KV load too and ends
/// with `[DONE]` and no chunk of the answer. The client's stream ends with the proxy's
/// error event (not `[DONE]`, not the continuation's usage chunk), and the request is a
/// failure, its continuation's decode told failed.
#[tokio::test(start_paused = true)]
async fn a_continuation_that_ends_with_no_answer_and_no_migration_left_fails_the_stream() {
    for decode_only in [true, false] {
        let what = format!("decode-only: {decode_only}");
        let fake = Fake::new();
        let told = Told::default();
        kv_failing_chat(&fake);
        let orch = listened(&fake, continuing(1, decode_only), told.clone());
        let (text, events) = streamed(&orch, chat(&orch)).await;
        assert_eq!(fake.calls_to(D2).len(), 1, "{what}: one continuation");
        let last = events.last().unwrap_or_else(|| panic!("{what}: {text}"));
        assert_eq!(
            last["error"]["code"], "decode_stream_failed",
            "{what}: {text}"
        );
        assert!(!text.contains(DONE), "{what}: {text}");
        assert!(!text.contains("\"usage\""), "{what}: {text}");
        let summary = told.summary();
        assert_eq!(
            (
                summary.delivery,
                summary.outcome,
                summary.error,
                summary.migrations
            ),
            (Delivery::Broken, "error", Some("decode_stream_failed"), 1),
            "{what}"
        );
        let all = told.reports();
        assert!(
            all.iter().any(|r| blamed(r, D2)),
            "{what}: the continuation's decode is told failed: {all:?}"
        );
        assert!(
            all.iter().any(|r| blamed(r, D1)),
            "{what}: the first decode is told failed: {all:?}"
        );
        assert_settled(&orch);
    }
}

/// As above with migration allowed twice: the continuation that ended with no answer is
/// a broken stream, continued on a third decode, which finishes the answer. The
/// transient failure is recovered.
#[tokio::test(start_paused = true)]
async fn a_continuation_that_ends_with_no_answer_is_continued_while_the_limit_allows() {
    let fake = Fake::new();
    let told = Told::default();
    kv_failing_chat(&fake).on(
        D3,
        COMPLETIONS,
        Reply::sse()
            .frame(ms(0), continued("C", 9, Some("length")))
            .frame(ms(0), usage_chunk(3, 1))
            .frame(ms(0), DONE),
    );
    let orch = over(
        &fake,
        &[P1],
        &[D1, D2, D3],
        VllmNixl::new(),
        continuing(2, true),
    )
    .listener(told.clone())
    .build();
    let (text, events) = streamed(&orch, chat(&orch)).await;
    assert_clean_end(&events, "two continuations", &text);
    let finished: Vec<&Value> = events
        .iter()
        .filter(|e| e["choices"][0]["finish_reason"].is_string())
        .collect();
    assert_eq!(finished.len(), 1, "{text}");
    assert_eq!(finished[0]["choices"][0]["delta"]["content"], "C", "{text}");
    // One usage chunk, D3's (not D2's, which came before any finish), counting the
    // prompt's 3 tokens and the one generated.
    assert_one_usage(&events, 3, 1, "two continuations", &text);
    let summary = told.summary();
    assert_eq!(
        (summary.delivery, summary.outcome, summary.migrations),
        (Delivery::Complete, "success", 2)
    );
    let all = told.reports();
    assert!(all.iter().any(|r| blamed(r, D2)), "{all:?}");
    assert_settled(&orch);
}

/// A streamed completions request whose first decode's KV load fails says nothing of
/// the answer (no chunk, or only its usage chunk) and ends with `[DONE]`: a broken
/// stream with no token generated, continued on the other decode from the client's
/// prompt, which finishes the answer. The client sees one answer, the first leg's usage
/// chunk (no token) not among it.
#[tokio::test(start_paused = true)]
async fn a_completions_first_leg_that_ends_with_no_answer_is_continued() {
    for (usage, decode_only) in [(false, true), (true, true), (false, false), (true, false)] {
        let what = format!("usage: {usage}, decode-only: {decode_only}");
        let fake = Fake::new();
        let told = Told::default();
        let rest = from_the_prompt();
        let rest = if usage {
            rest.frame(ms(0), usage_chunk(3, 2))
        } else {
            rest
        };
        kv_failing_completion(&fake, usage).on(D2, COMPLETIONS, rest.frame(ms(0), DONE));
        let orch = listened(&fake, continuing(1, decode_only), told.clone());
        let options = if usage {
            r#","stream_options":{"include_usage":true}"#
        } else {
            ""
        };
        let client =
            format!(r#"{{"model":"m","prompt":"hi","stream":true,"max_tokens":2{options}}}"#);
        let (text, events) = streamed(&orch, completion(&orch, &client)).await;
        assert_clean_end(&events, &what, &text);
        let chunks: Vec<&Value> = events.iter().filter(|e| e.is_object()).collect();
        let answer: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(answer, "BC", "{what}: {text}");
        for c in &chunks {
            assert_eq!(
                (&c["id"], &c["object"]),
                (&chunks[0]["id"], &chunks[0]["object"]),
                "{what}: {text}"
            );
            assert!(c.get("prompt_token_ids").is_none(), "{what}: {text}");
        }
        if usage {
            assert_one_usage(&events, 3, 2, &what, &text);
        } else {
            assert!(
                events.iter().all(|e| !e["usage"].is_object()),
                "{what}: {text}"
            );
        }
        // The continuation asks for the whole answer, from the client's prompt.
        let sent = fake.calls_to(D2);
        let [sent] = &sent[..] else {
            panic!("{what}: one continuation: {sent:?}")
        };
        let sent = sent.json();
        assert_eq!(
            (&sent["prompt"], &sent["max_tokens"]),
            (&json!("hi"), &json!(2)),
            "{what}: {sent}"
        );
        let summary = told.summary();
        assert_eq!(
            (summary.delivery, summary.outcome, summary.migrations),
            (Delivery::Complete, "success", 1),
            "{what}"
        );
        let all = told.reports();
        assert!(all.iter().any(|r| blamed(r, D1)), "{what}: {all:?}");
        assert_settled(&orch);
    }
}

/// A streamed completions request whose only decode's KV load fails, with nowhere left
/// to continue it: the client's stream ends with the proxy's error event (the failed
/// continuation's, as for any stream that ended early), and the request is a failure,
/// not a success with no token.
#[tokio::test(start_paused = true)]
async fn a_completions_stream_with_no_answer_and_no_decode_left_fails() {
    let fake = Fake::new();
    let told = Told::default();
    kv_failing_completion(&fake, false);
    let orch = over(&fake, &[P1], &[D1], VllmNixl::new(), continuing(1, true))
        .listener(told.clone())
        .build();
    let client = r#"{"model":"m","prompt":"hi","stream":true,"max_tokens":2}"#;
    let (text, events) = streamed(&orch, completion(&orch, client)).await;
    let [last] = &events[..] else {
        panic!("the error event alone: {text}")
    };
    assert_eq!(last["error"]["code"], "no_decode_endpoint", "{text}");
    let summary = told.summary();
    assert_eq!(
        (summary.delivery, summary.outcome, summary.error),
        (Delivery::Broken, "error", Some("no_decode_endpoint"))
    );
    assert!(told.reports().iter().any(|r| blamed(r, D1)));
    assert_settled(&orch);
}

/// A continuation whose body ends before `[DONE]` and before its finish reason, with no
/// migration left: the client's stream ends with the proxy's error event, not a clean
/// end that looks like an answer cut short by nobody.
#[tokio::test(start_paused = true)]
async fn a_continuation_that_ends_early_with_no_migration_left_ends_with_the_error_event() {
    let fake = Fake::new();
    let told = Told::default();
    continued_once(
        &fake,
        prefill_answer(),
        Reply::sse().frame(ms(0), continued("B", 8, None)),
    );
    let orch = listened(&fake, continuing(1, true), told.clone());
    let (text, events) = streamed(&orch, chat(&orch)).await;
    assert!(text.contains("\"B\""), "{text}");
    assert_eq!(
        events.last().map(|e| &e["error"]["code"]),
        Some(&json!("decode_stream_failed")),
        "{text}"
    );
    let summary = told.summary();
    assert_eq!(
        (summary.delivery, summary.error, summary.migrations),
        (Delivery::Broken, Some("decode_stream_failed"), 1)
    );
    assert_settled(&orch);
}

/// A healthy stream is untouched, its finish reason found however the engine spaced its
/// JSON: a first leg whose finish is written `"finish_reason": "stop"` ends with its
/// `[DONE]`, no continuation sent.
#[tokio::test(start_paused = true)]
async fn a_finished_stream_spaced_as_any_json_ends_as_it_came() {
    let fake = Fake::new();
    let told = Told::default();
    let last = r#"data: {"id": "c-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"content": "B"}, "token_ids": [8], "finish_reason" :	"stop"}]}"#.to_owned() + "\n\n";
    healthy(&fake, &[last]);
    let orch = listened(&fake, continuing(1, true), told.clone());
    let (text, _) = streamed(&orch, chat(&orch)).await;
    assert!(text.ends_with(DONE), "{text}");
    assert!(!text.contains("error"), "{text}");
    assert_untouched(&fake, &told, &orch);
}

/// A completions client whose prompt's tokenizing settings, cache salt and own ids are
/// set, with a first decode whose KV load fails (no answer): its continuation on D2,
/// from the client's prompt, answers "B" (the prompt's ids on its first chunk's choice)
/// then "C" to the end. The client's stream read, and the body D2 was sent.
async fn salted_completion_continued() -> (Vec<Value>, Value) {
    let fake = Fake::new();
    let told = Told::default();
    kv_failing_completion(&fake, false).on(D2, COMPLETIONS, from_the_prompt().frame(ms(0), DONE));
    let orch = listened(&fake, continuing(1, true), told.clone());
    let client = r#"{"model":"m","prompt":"hi","stream":true,"max_tokens":2,"add_special_tokens":false,"truncate_prompt_tokens":5,"cache_salt":"tenant-a","return_token_ids":true}"#;
    let (text, events) = streamed(&orch, completion(&orch, client)).await;
    assert_clean_end(&events, "salted", &text);
    let sent = fake.calls_to(D2);
    let [sent] = &sent[..] else {
        panic!("one continuation: {sent:?}")
    };
    assert_eq!(told.summary().delivery, Delivery::Complete);
    assert_settled(&orch);
    (events, sent.json())
}

/// A continuation from the client's own text prompt tokenizes it as the client asked
/// (`add_special_tokens`, `truncate_prompt_tokens`) and keeps the client's prefix-cache
/// isolation (`cache_salt`).
#[tokio::test(start_paused = true)]
async fn a_continuation_from_the_clients_prompt_tokenizes_and_salts_it_as_the_client_asked() {
    let (_, sent) = salted_completion_continued().await;
    assert_eq!(
        (
            &sent["prompt"],
            &sent["add_special_tokens"],
            &sent["truncate_prompt_tokens"],
            &sent["cache_salt"]
        ),
        (&json!("hi"), &json!(false), &json!(5), &json!("tenant-a")),
        "{sent}"
    );
}

/// When nothing of the answer came before the continuation, its first chunk is the
/// client's first: a client that asked for `return_token_ids` gets the prompt's ids on
/// it, as from one engine.
#[tokio::test(start_paused = true)]
async fn the_clients_first_chunk_from_a_continuation_carries_the_prompts_ids() {
    let (events, _) = salted_completion_continued().await;
    let chunks: Vec<&Value> = events.iter().filter(|e| e.is_object()).collect();
    let first = chunks.first().expect("a chunk");
    assert_eq!(
        (
            &first["choices"][0]["text"],
            &first["choices"][0]["prompt_token_ids"],
            &first["choices"][0]["token_ids"]
        ),
        (&json!("B"), &json!([1, 2, 3]), &json!([8])),
        "{events:?}"
    );
    assert!(
        chunks[1..]
            .iter()
            .all(|c| c["choices"][0].get("prompt_token_ids").is_none()),
        "{events:?}"
    );
}

/// A healthy tracked first leg asked for usage runs to its end: its finish, then its
/// usage chunk, relayed once, then `[DONE]`; no continuation.
#[tokio::test(start_paused = true)]
async fn a_healthy_first_legs_usage_chunk_is_relayed_once_after_its_finish() {
    let fake = Fake::new();
    let told = Told::default();
    let last = r#"data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"B"},"token_ids":[8],"finish_reason":"stop"}]}"#.to_owned() + "\n\n";
    let usage = r#"data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2}}"#.to_owned() + "\n\n";
    healthy(&fake, &[last, usage]);
    let orch = listened(&fake, continuing(1, true), told.clone());
    // The client's chat asks for usage (`CLIENT`).
    let (text, events) = streamed(&orch, chat(&orch)).await;
    let n = events.len();
    assert!(n >= 3, "{text}");
    assert_eq!(events[n - 1], json!("[DONE]"), "{text}");
    assert_eq!(
        events[n - 2]["usage"],
        json!({"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}),
        "{text}"
    );
    assert_eq!(
        events[n - 3]["choices"][0]["finish_reason"],
        "stop",
        "{text}"
    );
    assert_one_usage(&events, 3, 2, "a healthy first leg", &text);
    assert_untouched(&fake, &told, &orch);
}
