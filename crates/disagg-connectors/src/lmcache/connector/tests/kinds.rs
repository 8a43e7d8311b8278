//! What a completions prompt of each shape comes to, small and large: refused as a
//! batch, carried as the client's token ids, or tokenized by the prefill's `/tokenize`.

use std::sync::Mutex;

use super::*;

/// What `prepare` then `resolve` made of a request.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// Refused (400), with this message.
    Refused(String),
    /// Carried as these ids (the decode leg's prompt), no `/tokenize` of the prompt
    /// asked (the context length's may be: [`PROBE`]).
    Ids(String),
    /// Tokenized: the `/tokenize` body asked.
    Tokenized(String),
    /// Failed otherwise, with the innermost reason.
    Failed(String),
}

/// Answers every request as a prefill's `/tokenize` (three ids), keeping the bodies.
#[derive(Default)]
struct Recorder(Mutex<Vec<Bytes>>);

impl Recorder {
    fn asked(&self) -> Vec<Bytes> {
        self.0.lock().map(|b| b.clone()).unwrap_or_default()
    }
}

impl Transport for Recorder {
    fn send(&self, req: http::Request<Bytes>) -> disagg_core::transport::ResponseFuture {
        if let Ok(mut asked) = self.0.lock() {
            asked.push(req.into_body());
        }
        let body = http_body_util::Full::new(Bytes::from_static(
            br#"{"count":3,"max_model_len":8,"tokens":[7,8,9]}"#,
        ))
        .map_err(|never| match never {})
        .boxed();
        Box::pin(
            async move { Ok::<_, disagg_core::error::TransportError>(http::Response::new(body)) },
        )
    }
}

fn failed(e: ConnectorError) -> Outcome {
    let message = e.to_string();
    let mut inner: &dyn std::error::Error = &e;
    while let Some(source) = inner.source() {
        inner = source;
    }
    let inner = inner.to_string();
    let pd = disagg_core::error::PdError::connector(disagg_core::error::Side::Prefill, e);
    if pd.http().status.as_u16() == 400 {
        Outcome::Refused(message)
    } else {
        Outcome::Failed(inner)
    }
}

/// `req` through `c`'s `prepare` and `resolve`.
async fn outcome(c: &Lmcache, req: &PdRequest) -> Outcome {
    let engine = Recorder::default();
    let mut h = match c.prepare(&route(Some(receiver())), req) {
        Ok(h) => h,
        Err(e) => return failed(e),
    };
    if let Err(e) = c.resolve(&mut h, &engine).await {
        return failed(e);
    }
    match engine.asked().iter().find(|body| &body[..] != PROBE) {
        Some(body) => Outcome::Tokenized(String::from_utf8_lossy(body).into_owned()),
        None => {
            Outcome::Ids(String::from_utf8_lossy(h.decode.body.get("prompt").unwrap_or(b"")).into())
        }
    }
}

/// The `/tokenize` asking the context length of a request whose ids were known (its
/// limit's room is checked), not the prompt's.
const PROBE: &[u8] = br#"{"model":"m","prompt":"."}"#;

fn completion(prompt: &str) -> PdRequest {
    request(
        Api::Completions,
        &format!(r#"{{"model":"m","prompt":{prompt},"max_tokens":5}}"#),
    )
}

/// 280 KB of `0,`: with it a list is past `READ_OFF_LOOP_FROM`.
fn pad() -> String {
    "0,".repeat(140_000)
}

const BATCH: &str = "the lmcache connector cannot serve a batch of prompts";
const EMPTY: &str = "the lmcache connector cannot serve an empty prompt (no token ids)";

fn refused() -> Outcome {
    Outcome::Refused(BATCH.to_owned())
}

fn tokenized(prompt: &str) -> Outcome {
    Outcome::Tokenized(format!(r#"{{"model":"m","prompt":{prompt}}}"#))
}

/// Each shape of prompt, small and past `READ_OFF_LOOP_FROM`, and what it comes to:
/// a list holding a string or a list anywhere is a batch (refused); a list of
/// integers that fit a `u64` is the client's ids; anything else goes to `/tokenize`
/// as written.
#[tokio::test]
async fn every_prompt_shape_keeps_its_outcome() {
    let pad = pad();
    let strings = format!(r#"[{}"b"]"#, r#""a","#.repeat(70_000));
    let text = format!(r#""{}""#, "a".repeat(300_000));
    let spaced = format!("[{}]", " ".repeat(300_000));
    let cases: Vec<(String, Outcome)> = vec![
        // A batch of strings.
        (r#"["a","b"]"#.into(), refused()),
        (strings.clone(), refused()),
        // A batch of id lists.
        ("[[1],[2]]".into(), refused()),
        (format!("[[{pad}1],[2]]"), refused()),
        // A single id list.
        ("[1,2,3]".into(), Outcome::Ids("[1,2,3]".into())),
        (format!("[{pad}1]"), Outcome::Ids(format!("[{pad}1]"))),
        // Mixed: a string or a list anywhere makes a batch.
        (r#"[1,"a"]"#.into(), refused()),
        ("[1,[2]]".into(), refused()),
        (format!(r#"[{pad}"a"]"#), refused()),
        (format!("[{pad}[1]]"), refused()),
        (r#"[-1,"a"]"#.into(), refused()),
        (format!(r#"[-1,{pad}"a"]"#), refused()),
        // Other types: not ids, to `/tokenize` as written (the engine's to refuse).
        ("[1,2.5]".into(), tokenized("[1,2.5]")),
        ("[1,-2]".into(), tokenized("[1,-2]")),
        ("[1,true]".into(), tokenized("[1,true]")),
        ("[1,null]".into(), tokenized("[1,null]")),
        ("[1,{}]".into(), tokenized("[1,{}]")),
        (
            "[18446744073709551616]".into(),
            tokenized("[18446744073709551616]"),
        ),
        (format!("[{pad}2.5]"), tokenized(&format!("[{pad}2.5]"))),
        (format!("[{pad}{{}}]"), tokenized(&format!("[{pad}{{}}]"))),
        (format!("[-1,{pad}1]"), tokenized(&format!("[-1,{pad}1]"))),
        // Text.
        (r#""hi""#.into(), tokenized(r#""hi""#)),
        (text.clone(), tokenized(&text)),
        ("7".into(), tokenized("7")),
        // No ids at all: the prompt is empty, the client's fault.
        ("[]".into(), Outcome::Refused(EMPTY.into())),
        (spaced, Outcome::Refused(EMPTY.into())),
    ];
    let c = connector();
    for (prompt, want) in cases {
        let got = outcome(&c, &completion(&prompt)).await;
        assert_eq!(got, want, "{prompt:.80}");
    }
}

/// A batch is refused as one whatever the token ceiling, however many ids come
/// before its first string; a list of ids only is held to the ceiling.
#[tokio::test]
async fn a_batch_is_a_batch_past_the_token_ceiling() {
    let pad = pad();
    let c = connector().with_max_prompt_tokens(10);
    assert_eq!(
        outcome(&c, &completion(&format!(r#"[{pad}"a"]"#))).await,
        refused()
    );
    assert_eq!(
        outcome(&c, &completion(&format!("[{pad}1]"))).await,
        Outcome::Refused(
            "the lmcache connector cannot serve a prompt of more than 10 token ids".into()
        )
    );
}

/// Ids the orchestrator already has stand for the prompt; a batch is still refused.
#[tokio::test]
async fn known_ids_stand_for_any_prompt_but_a_batch() {
    let pad = pad();
    let c = connector();
    let known = |prompt: &str| {
        let mut req = completion(prompt);
        req.set_tokens(Some(Arc::from(vec![5_u32, 6])));
        req
    };
    for prompt in [
        r#""hi""#.to_owned(),
        "[1,2.5]".into(),
        format!("[{pad}2.5]"),
        format!("[{pad}1]"),
    ] {
        assert_eq!(
            outcome(&c, &known(&prompt)).await,
            Outcome::Ids("[5,6]".into()),
            "{prompt:.80}"
        );
    }
    for prompt in [
        r#"["a"]"#.to_owned(),
        format!(r#"[{pad}"a"]"#),
        format!("[[{pad}1]]"),
    ] {
        assert_eq!(
            outcome(&c, &known(&prompt)).await,
            refused(),
            "{prompt:.80}"
        );
    }
}

/// A large prompt whose shape its first element does not settle is not walked on the
/// event loop by `prepare`: `resolve` walks it on the blocking pool (the event loop
/// runs another task meanwhile), and it comes to what it always did. A small one is
/// told apart inline, by `prepare`.
#[test]
fn a_large_prompt_is_told_apart_off_the_event_loop() {
    let pad = pad();
    let float = format!("[{pad}2.5]");
    for (prompt, want) in [
        (format!(r#"[{pad}"a"]"#), refused()),
        (float.clone(), tokenized(&float)),
    ] {
        let c = connector();
        let mut h = match c.prepare(&route(Some(receiver())), &completion(&prompt)) {
            Ok(h) => h,
            Err(e) => panic!("{prompt:.80}: refused on the event loop: {e}"),
        };
        let engine = Recorder::default();
        let (got, ticks) = ticks_while(c.resolve(&mut h, &engine));
        assert!(ticks > 0, "{prompt:.80}: walked on the event loop");
        let got = match (got, engine.asked().first()) {
            (Err(e), _) => failed(e),
            (Ok(()), Some(body)) => Outcome::Tokenized(String::from_utf8_lossy(body).into()),
            (Ok(()), None) => panic!("{prompt:.80}: carried as ids"),
        };
        assert_eq!(got, want, "{prompt:.80}");
    }
    let c = connector();
    let small = c.prepare(&route(Some(receiver())), &completion(r#"[1,"a"]"#));
    assert!(matches!(small, Err(ConnectorError::Unsupported { .. })));
}

/// A chat of `pad` bytes of text in a first message, then `last` as the content of a
/// second.
fn chat(pad: usize, last: &str) -> PdRequest {
    request(
        Api::Chat,
        &format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}},{{"role":"user","content":{last}}}]}}"#,
            "a".repeat(pad)
        ),
    )
}

const IMAGE: &str =
    r#"[{"type":"text","text":"see"},{"type":"image_url","image_url":{"url":"data:,"}}]"#;
const SHORTHAND: &str = r#"[{"audio\u005furl":{"url":"x"}}]"#;
const TEXT: &str = r#"[{"type":"text","text":"the word \"image_url\""}]"#;

/// A chat with a media part anywhere is refused (400) naming the part's kind, small or
/// past `READ_OFF_LOOP_FROM`; a text chat is tokenized (its messages as written).
#[tokio::test]
async fn every_chat_keeps_its_media_outcome() {
    let c = connector();
    for pad in [10, 300_000] {
        for (last, kind) in [
            (IMAGE, Some("image_url")),
            (SHORTHAND, Some("audio_url")),
            (TEXT, None),
        ] {
            let got = outcome(&c, &chat(pad, last)).await;
            match (kind, got) {
                (Some(kind), Outcome::Refused(m)) => assert!(m.contains(kind), "{pad}: {m}"),
                (None, Outcome::Tokenized(body)) => {
                    assert!(
                        body.ends_with(&format!(r#"{last}}}],"add_generation_prompt":true}}"#)),
                        "{pad}"
                    );
                }
                (kind, got) => panic!("{pad} {kind:?}: {got:?}"),
            }
        }
    }
}

/// A large chat is looked through for media parts on the blocking pool, by `resolve`,
/// not on the event loop by `prepare` (a small one is, inline).
#[test]
fn a_large_chat_is_looked_through_off_the_event_loop() {
    for (last, refused) in [(IMAGE, true), (TEXT, false)] {
        let c = connector();
        let mut h = match c.prepare(&route(Some(receiver())), &chat(300_000, last)) {
            Ok(h) => h,
            Err(e) => panic!("{last}: refused on the event loop: {e}"),
        };
        let engine = Recorder::default();
        let (got, ticks) = ticks_while(c.resolve(&mut h, &engine));
        assert!(ticks > 0, "{last}: looked through on the event loop");
        match got {
            Err(e) => {
                assert!(refused, "{last}: {e}");
                assert!(matches!(failed(e), Outcome::Refused(m) if m.contains("image_url")));
                assert!(engine.asked().is_empty());
            }
            Ok(()) => assert!(!refused && engine.asked().len() == 1, "{last}"),
        }
    }
    let small = connector().prepare(&route(Some(receiver())), &chat(10, IMAGE));
    assert!(matches!(small, Err(ConnectorError::Unsupported { .. })));
}
