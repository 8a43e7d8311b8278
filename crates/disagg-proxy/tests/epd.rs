//! Encoder disaggregation (E/P/D, issue #34), with the real `disagg-proxy serve` binary
//! in front of simulated vLLM engines over loopback: encoder-only engines write each
//! media item's embeddings into a directory they share with the prefill (as vLLM's
//! shared-storage EC connector does), and the simulated prefill fails any request whose
//! items were never encoded, so a skipped or misnamed encoder leg really fails.

#![allow(missing_docs)] // a test binary

use disagg_sim::{EcConfig, EcRole, Faults, SimConfig, SimEngine};
use serde_json::{Value, json};

mod common;
use common::certs::TempDir;
use common::{Proxy, get, post};

async fn engine(ec: Option<(EcRole, &TempDir)>) -> SimEngine {
    SimEngine::start(SimConfig {
        ec: ec.map(|(role, dir)| EcConfig {
            role,
            store: dir.0.clone(),
        }),
        ..SimConfig::default()
    })
    .await
    .expect("start a simulated engine")
}

fn image(n: usize) -> Value {
    json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,AAAA{n}")}})
}

fn chat(images: usize, stream: bool) -> String {
    let mut content = vec![json!({"type": "text", "text": "what is in these pictures?"})];
    content.extend((0..images).map(image));
    json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "stream": stream,
    })
    .to_string()
}

struct Epd {
    _store: TempDir,
    encoders: Vec<SimEngine>,
    prefill: Option<SimEngine>,
    decode: SimEngine,
    proxy: Proxy,
}

impl Epd {
    /// Two encoders, a consuming prefill and a plain decode; or, with `pd`, no prefill
    /// and a consuming decode (E → PD).
    async fn start(pd: bool) -> Epd {
        Self::start_with(pd, &[]).await
    }

    /// [`start`](Self::start) with `extra` proxy flags.
    async fn start_with(pd: bool, extra: &[&str]) -> Epd {
        let store = TempDir::new();
        let encoders = vec![
            engine(Some((EcRole::Producer, &store))).await,
            engine(Some((EcRole::Producer, &store))).await,
        ];
        let (prefill, decode) = if pd {
            (None, engine(Some((EcRole::Consumer, &store))).await)
        } else {
            (
                Some(engine(Some((EcRole::Consumer, &store))).await),
                engine(None).await,
            )
        };
        let mut args = Vec::new();
        if let Some(p) = &prefill {
            args.extend(["--prefill".to_owned(), p.url()]);
        }
        args.extend(["--decode".to_owned(), decode.url()]);
        for e in &encoders {
            args.extend(["--encode".to_owned(), e.url()]);
        }
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        let proxy = Proxy::start_args(&args).await;
        Epd {
            _store: store,
            encoders,
            prefill,
            decode,
            proxy,
        }
    }

    fn encoded(&self) -> u64 {
        self.encoders
            .iter()
            .map(|e| e.stats().ec_items_encoded)
            .sum()
    }

    fn encoder_requests(&self) -> u64 {
        self.encoders.iter().map(|e| e.stats().requests).sum()
    }

    /// The engine that consumes the encoders' output.
    fn consumer(&self) -> &SimEngine {
        self.prefill.as_ref().unwrap_or(&self.decode)
    }
}

/// The reference answer: the same request served by a plain engine (media items are
/// placeholder words to the simulator's template).
async fn reference(body: &str) -> String {
    let plain = engine(None).await;
    let a = post(&plain.url(), "/v1/chat/completions", body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    a.chat_content()
}

async fn serves_images(pd: bool) {
    let epd = Epd::start(pd).await;
    let mut loaded = 0;
    for (images, stream) in [(1, false), (2, false), (1, true), (2, true)] {
        let body = chat(images, stream);
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.chat_content(), reference(&chat(images, stream)).await);
        loaded += images as u64;
        // The consumer read every item from the encoders' store.
        assert_eq!(epd.consumer().stats().ec_items_loaded, loaded);
        assert_eq!(epd.encoded(), loaded);
        // The client never sees the encoders' handoff.
        assert!(!a.text().contains("ec_transfer_params"), "{}", a.text());
    }
    // The consumer's legs carried the merged ec_transfer_params, keyed by the uuids the
    // encoder legs gave the items.
    let last = epd.consumer().requests().pop().expect("a recorded request");
    let params = last.body["ec_transfer_params"]
        .as_object()
        .expect("an object")
        .clone();
    let content = last.body["messages"][0]["content"]
        .as_array()
        .unwrap()
        .clone();
    let uuids: Vec<&str> = content.iter().filter_map(|p| p["uuid"].as_str()).collect();
    assert_eq!(uuids.len(), 2);
    for u in uuids {
        assert_eq!(params[u]["modality"], "image", "{params:?}");
    }
    // Every encoder leg is unstreamed and one token long.
    for e in &epd.encoders {
        for r in e.requests() {
            assert_eq!(r.body["stream"], false);
            assert_eq!(r.body["max_tokens"], 1);
            assert!(
                r.header("x-request-id")
                    .is_some_and(|id| id.contains("-enc"))
            );
        }
    }
    if !pd {
        assert_eq!(epd.decode.stats().ec_items_loaded, 0);
    }
    let m = epd.proxy.metric("disagg_encode_items_total").await;
    assert_eq!(m, loaded);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_p_d_serves_one_and_two_images_streamed_and_not() {
    serves_images(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_pd_serves_one_and_two_images_streamed_and_not() {
    serves_images(true).await;
}

// === Embeddings placeholders (--encode-placeholders) ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placeholders_keep_the_media_bytes_away_from_the_prefill_and_decode() {
    let epd = Epd::start_with(false, &["--encode-placeholders"]).await;
    for stream in [false, true] {
        let body = chat(2, stream);
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.chat_content(), reference(&body).await);
    }
    // The consumer read every item's embeddings, named by the placeholders' uuids.
    assert_eq!(epd.consumer().stats().ec_items_loaded, 4);
    assert_eq!(epd.encoded(), 4);
    let leg = epd.consumer().requests().pop().expect("a recorded request");
    let params = leg.body["ec_transfer_params"].as_object().expect("params");
    let content = leg.body["messages"][0]["content"].as_array().unwrap();
    assert_eq!(content[0]["type"], "text");
    for part in &content[1..] {
        assert_eq!(part["type"], "image_embeds", "{part}");
        assert!(part["image_embeds"].is_null(), "{part}");
        let uuid = part["uuid"].as_str().expect("a uuid");
        assert_eq!(params[uuid]["modality"], "image");
    }
    // No engine after the encoders received the media bytes.
    let decode = epd.decode.requests();
    for r in epd.consumer().requests().iter().chain(&decode) {
        let text = r.body.to_string();
        assert!(!text.contains("base64") && !text.contains("AAAA"), "{text}");
    }
    // The encoders did.
    let legs: Vec<_> = epd.encoders.iter().flat_map(SimEngine::requests).collect();
    assert!(
        legs.iter()
            .any(|r| r.body.to_string().contains("base64,AAAA0"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placeholders_carry_videos_as_video_embeds_parts() {
    // Two videos and an image: every item handed over, so each modality is rewritten
    // (vLLM 0.33's `video_embeds` part, `renderers/chat_utils/types.py`).
    let epd = Epd::start_with(true, &["--encode-placeholders"]).await;
    let video = |n: usize| json!({"type": "video_url", "video_url": {"url": format!("data:video/mp4;base64,VklE{n}")}});
    for stream in [false, true] {
        let body = json!({
            "model": "sim-model",
            "max_tokens": 6,
            "stream": stream,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what happens?"}, video(0), image(0), video(1)]}],
        })
        .to_string();
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.chat_content(), reference(&body).await);
    }
    assert_eq!(epd.consumer().stats().ec_items_loaded, 6);
    let leg = epd.consumer().requests().pop().expect("a recorded request");
    let params = leg.body["ec_transfer_params"].as_object().expect("params");
    let content = leg.body["messages"][0]["content"].as_array().unwrap();
    for (i, modality) in [(1, "video"), (2, "image"), (3, "video")] {
        let part = &content[i];
        let ty = format!("{modality}_embeds");
        assert_eq!(part["type"], ty.as_str(), "{part}");
        assert!(part[ty.as_str()].is_null(), "{part}");
        let uuid = part["uuid"].as_str().expect("a uuid");
        assert_eq!(params[uuid]["modality"], modality);
    }
    // No engine after the encoders received a video's bytes.
    for r in epd.consumer().requests() {
        let text = r.body.to_string();
        assert!(!text.contains("VklE") && !text.contains("AAAA"), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_video_no_encoder_answered_for_keeps_every_videos_media() {
    // One leg per video; the second encoder answers no entries, so with two videos one
    // has no entry: vLLM refuses raw and embedded videos in one request, so both keep
    // their media, and the consumer still reads both from the store.
    let epd = Epd::start_with(true, &["--encode-placeholders"]).await;
    epd.encoders[1].set_faults(Faults {
        ec_withhold_params: true,
        ..Faults::default()
    });
    let video = |n: usize| json!({"type": "video_url", "video_url": {"url": format!("data:video/mp4;base64,VklE{n}")}});
    let body = json!({
        "model": "sim-model",
        "max_tokens": 6,
        "messages": [{"role": "user", "content": [video(0), video(1)]}],
    })
    .to_string();
    let a = post(&epd.proxy.url(), "/v1/chat/completions", &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.chat_content(), reference(&body).await);
    let leg = epd.consumer().requests().pop().expect("a recorded request");
    assert_eq!(leg.body["ec_transfer_params"].as_object().unwrap().len(), 1);
    let content = leg.body["messages"][0]["content"].as_array().unwrap();
    assert!(
        content.iter().all(|p| p["type"] == "video_url"),
        "{content:?}"
    );
    assert_eq!(epd.consumer().stats().ec_items_loaded, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_processor_kwargs_placeholders_keep_the_media_and_the_items_still_load() {
    // vLLM names an item by its uuid only when the request has no processor kwargs;
    // with them the encoders' entries are keyed by a hash of uuid and kwargs, which
    // the proxy cannot name a placeholder by: the items keep their media, and the
    // consumer (hashing alike) still finds every one.
    let epd = Epd::start_with(false, &["--encode-placeholders"]).await;
    let mut body: Value = serde_json::from_str(&chat(2, false)).unwrap();
    body["mm_processor_kwargs"] = json!({"max_pixels": 1024});
    let body = body.to_string();
    let a = post(&epd.proxy.url(), "/v1/chat/completions", &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.chat_content(), reference(&body).await);
    assert_eq!(epd.consumer().stats().ec_items_loaded, 2);
    let leg = epd.consumer().requests().pop().expect("a recorded request");
    let params = leg.body["ec_transfer_params"].as_object().expect("params");
    let content = leg.body["messages"][0]["content"].as_array().unwrap();
    for part in &content[1..] {
        assert_eq!(part["type"], "image_url", "{part}");
        let uuid = part["uuid"].as_str().expect("a uuid");
        assert!(params.get(uuid).is_none(), "{params:?}");
    }
    assert_eq!(params.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_no_encoder_answered_for_keeps_its_media() {
    // One leg per item, and one encoder that encodes but answers no entries: of two
    // items sent at once, one gets an entry and the other none.
    let epd = Epd::start_with(
        false,
        &["--encode-placeholders", "--encode-image-batch", "1"],
    )
    .await;
    epd.encoders[1].set_faults(Faults {
        ec_withhold_params: true,
        ..Faults::default()
    });
    let audio = json!({"type": "input_audio", "input_audio": {"data": "QVVE", "format": "wav"}});
    let body = json!({
        "model": "sim-model",
        "max_tokens": 6,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what do you see and hear?"}, image(0), audio]}],
    })
    .to_string();
    let a = post(&epd.proxy.url(), "/v1/chat/completions", &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.chat_content(), reference(&body).await);
    let leg = epd.consumer().requests().pop().expect("a recorded request");
    let params = leg.body["ec_transfer_params"].as_object().expect("params");
    assert_eq!(params.len(), 1, "{params:?}");
    let content = leg.body["messages"][0]["content"].as_array().unwrap();
    let (image_part, audio_part) = (&content[1], &content[2]);
    let with_entry = |p: &Value| params.contains_key(p["uuid"].as_str().unwrap());
    // The item with an entry is a placeholder, the other keeps its media.
    assert_ne!(with_entry(image_part), with_entry(audio_part));
    for (part, raw, embeds) in [
        (image_part, "image_url", "image_embeds"),
        (audio_part, "input_audio", "audio_embeds"),
    ] {
        let want = if with_entry(part) { embeds } else { raw };
        assert_eq!(part["type"], want, "{part}");
    }
    // Two images, one without an entry: vLLM takes no mix of raw and embedded images,
    // so both keep their media.
    let body = chat(2, false);
    let a = post(&epd.proxy.url(), "/v1/chat/completions", &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let leg = epd.consumer().requests().pop().expect("a recorded request");
    assert_eq!(leg.body["ec_transfer_params"].as_object().unwrap().len(), 1);
    let content = leg.body["messages"][0]["content"].as_array().unwrap();
    assert!(
        content[1..].iter().all(|p| p["type"] == "image_url"),
        "{content:?}"
    );
    // Every item was read from the store all the same.
    assert_eq!(epd.consumer().stats().ec_items_loaded, 4);
}

// === /v1/responses and /v1/messages ===

const RESPONSES: &str = "/v1/responses";
const MESSAGES: &str = "/v1/messages";

/// A Responses request with `images` `input_image` parts (and, with `kwargs`, processor
/// kwargs the encoder legs must carry for the prefill to name the items alike).
fn responses(images: usize, stream: bool, kwargs: bool) -> String {
    let mut content = vec![json!({"type": "input_text", "text": "what is in these pictures?"})];
    content.extend((0..images).map(|n| {
        json!({"type": "input_image", "image_url": format!("data:image/png;base64,UkVT{n}"),
               "detail": "auto"})
    }));
    let mut body = json!({
        "model": "sim-model",
        "input": [{"type": "message", "role": "user", "content": content}],
        "max_output_tokens": 6,
        "stream": stream,
    });
    if kwargs {
        body["mm_processor_kwargs"] = json!({"max_pixels": 1024});
    }
    body.to_string()
}

/// A Messages request with `images` Anthropic `image` blocks, base64 and URL sources.
fn messages(images: usize, stream: bool) -> String {
    let mut content = vec![json!({"type": "text", "text": "what is in these pictures?"})];
    content.extend((0..images).map(|n| {
        if n % 2 == 0 {
            json!({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                "data": format!("TVNH{n}")}})
        } else {
            json!({"type": "image", "source": {"type": "url",
                                                "url": format!("https://example.com/{n}.png")}})
        }
    }));
    json!({
        "model": "sim-model",
        "max_tokens": 6,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
    })
    .to_string()
}

/// The `data:` payloads of a stream (bare or `event:`/`data:` pairs), as JSON.
fn sse_data(a: &common::Answer) -> Vec<Value> {
    a.text()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON event"))
        .collect()
}

/// The generated text of a Responses or Messages answer, streamed or not.
fn gen_text(a: &common::Answer) -> String {
    if a.header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream"))
    {
        sse_data(a)
            .iter()
            .filter_map(|v| match v["type"].as_str() {
                Some("response.output_text.delta") => v["delta"].as_str(),
                Some("content_block_delta") => v["delta"]["text"].as_str(),
                _ => None,
            })
            .collect()
    } else {
        let v = a.json();
        let text = if v["object"] == "response" {
            &v["output"][0]["content"][0]["text"]
        } else {
            &v["content"][0]["text"]
        };
        text.as_str().unwrap_or_default().to_owned()
    }
}

/// `body` at `path` served by a plain engine: the answer the proxy must give.
async fn reference_at(path: &str, body: &str) -> String {
    let plain = engine(None).await;
    let a = post(&plain.url(), path, body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    gen_text(&a)
}

async fn serves_responses_and_messages(pd: bool) {
    let epd = Epd::start(pd).await;
    let mut loaded = 0;
    for stream in [false, true] {
        for (path, body) in [
            (RESPONSES, responses(2, stream, false)),
            (RESPONSES, responses(1, stream, true)),
            (MESSAGES, messages(2, stream)),
        ] {
            let items = if body.contains("max_pixels") { 1 } else { 2 };
            let a = post(&epd.proxy.url(), path, &body).await;
            assert_eq!(a.status, 200, "{path}: {}", a.text());
            let text = gen_text(&a);
            assert!(!text.is_empty(), "{path}: {}", a.text());
            assert_eq!(
                text,
                reference_at(path, &body).await,
                "{path} stream {stream}"
            );
            assert!(!a.text().contains("ec_transfer_params"), "{}", a.text());
            loaded += items;
            // The consumer read every item from the encoders' store: the encoder legs
            // named them as the consumer's own hash of its route's parts does.
            assert_eq!(epd.consumer().stats().ec_items_loaded, loaded, "{path}");
            assert_eq!(epd.encoded(), loaded, "{path}");
            // The consumer's leg came by the client's route with the merged handoff, one
            // entry per item, and the client's items as they were (no uuid added: that
            // route would not pass it on).
            let leg = epd.consumer().requests().pop().expect("a recorded request");
            assert_eq!(leg.path, path);
            let params = leg.body["ec_transfer_params"].as_object().expect("params");
            assert_eq!(params.len() as u64, items, "{params:?}");
            assert!(!leg.body.to_string().contains("uuid"), "{}", leg.body);
        }
    }
    // The encoder legs are chat requests: items only, no uuid (the consumer hashes), the
    // Responses request's processor kwargs copied.
    let legs: Vec<_> = epd.encoders.iter().flat_map(SimEngine::requests).collect();
    assert!(legs.iter().all(|r| r.path == "/v1/chat/completions"));
    assert!(!legs.iter().any(|r| r.body.to_string().contains("uuid")));
    let with_kwargs = legs
        .iter()
        .filter(|r| r.body["mm_processor_kwargs"] == json!({"max_pixels": 1024}))
        .count();
    assert_eq!(with_kwargs, 2);
    let urls: Vec<&str> = legs
        .iter()
        .flat_map(|r| r.body["messages"][0]["content"].as_array().unwrap().iter())
        .filter_map(|p| p["image_url"]["url"].as_str())
        .collect();
    assert!(urls.contains(&"data:image/png;base64,TVNH0"), "{urls:?}");
    assert!(urls.contains(&"https://example.com/1.png"), "{urls:?}");
    if !pd {
        assert_eq!(epd.decode.stats().ec_items_loaded, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_p_d_serves_images_in_responses_and_messages_streamed_and_not() {
    serves_responses_and_messages(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_pd_serves_images_in_responses_and_messages_streamed_and_not() {
    serves_responses_and_messages(true).await;
}

/// A Responses request vLLM keeps (`store: true`) or one continuing a kept one: the
/// proxy serves it on a decode alone (`responses_state`).
fn kept_responses(images: usize, previous: bool) -> String {
    let mut body: Value = serde_json::from_str(&responses(images, false, false)).unwrap();
    if previous {
        body["previous_response_id"] = json!("resp_1");
    } else {
        body["store"] = json!(true);
    }
    body.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_request_kept_on_a_decode_that_loads_nothing_skips_the_encoders() {
    // E → P → D, the decode declaring no EC role: it would never load what the
    // encoders wrote, so the stage is skipped and the decode gets the media as sent.
    let epd = Epd::start(false).await;
    for previous in [false, true] {
        let body = kept_responses(2, previous);
        let a = post(&epd.proxy.url(), RESPONSES, &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(gen_text(&a), reference_at(RESPONSES, &body).await);
        let leg = epd.decode.requests().pop().expect("the decode served it");
        assert!(leg.body.get("ec_transfer_params").is_none(), "{}", leg.body);
        assert!(leg.body.to_string().contains("UkVT1"), "{}", leg.body);
    }
    assert_eq!(epd.encoder_requests(), 0);
    assert_eq!(epd.consumer().stats().requests, 0);
    assert_eq!(epd.proxy.metric("disagg_encode_skipped_total").await, 2);
    assert_eq!(epd.proxy.metric("disagg_encode_requests_total").await, 0);
    // A request disaggregated as usual still goes through the stage.
    let a = post(&epd.proxy.url(), RESPONSES, &responses(1, false, false)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(epd.consumer().stats().ec_items_loaded, 1);
    assert_eq!(epd.proxy.metric("disagg_encode_skipped_total").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_request_kept_on_a_consuming_decode_goes_through_the_encoders() {
    // E → P → D with a decode declared `ec_consumer` (--ec-profile), then E → PD: the
    // decode serving alone loads every item the encoders wrote.
    for pd in [false, true] {
        let store = TempDir::new();
        let encoders = vec![
            engine(Some((EcRole::Producer, &store))).await,
            engine(Some((EcRole::Producer, &store))).await,
        ];
        let prefill = engine(Some((EcRole::Consumer, &store))).await;
        let decode = engine(Some((EcRole::Consumer, &store))).await;
        let mut args = Vec::new();
        if !pd {
            args.extend([
                "--prefill".to_owned(),
                prefill.url(),
                "--ec-profile".to_owned(),
                format!("{}=example,ec_consumer", decode.url()),
            ]);
        }
        args.extend(["--decode".to_owned(), decode.url()]);
        for e in &encoders {
            args.extend(["--encode".to_owned(), e.url()]);
        }
        let proxy = Proxy::start_args(&args).await;
        let epd = Epd {
            _store: store,
            encoders,
            prefill: None,
            decode,
            proxy,
        };
        for previous in [false, true] {
            let body = kept_responses(2, previous);
            let a = post(&epd.proxy.url(), RESPONSES, &body).await;
            assert_eq!(a.status, 200, "pd {pd}: {}", a.text());
            assert_eq!(gen_text(&a), reference_at(RESPONSES, &body).await);
            let leg = epd.decode.requests().pop().expect("the decode served it");
            let params = leg.body["ec_transfer_params"].as_object().expect("params");
            assert_eq!(params.len(), 2, "{params:?}");
        }
        assert_eq!(epd.decode.stats().ec_items_loaded, 4, "pd {pd}");
        assert_eq!(epd.encoded(), 4);
        assert_eq!(prefill.stats().requests, 0);
        assert_eq!(epd.proxy.metric("disagg_encode_skipped_total").await, 0);
        assert_eq!(epd.proxy.metric("disagg_encode_requests_total").await, 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_only_responses_and_messages_never_touch_an_encoder() {
    let epd = Epd::start(false).await;
    for stream in [false, true] {
        for (path, body) in [
            (RESPONSES, responses(0, stream, false)),
            (MESSAGES, messages(0, stream)),
        ] {
            let a = post(&epd.proxy.url(), path, &body).await;
            assert_eq!(a.status, 200, "{path}: {}", a.text());
        }
    }
    // Text naming a media part type is text; so is a string input.
    let tricky = [
        (
            RESPONSES,
            json!({"model": "sim-model", "max_output_tokens": 3,
                   "input": "what is an \"input_image\"?"}),
        ),
        (
            MESSAGES,
            json!({"model": "sim-model", "max_tokens": 3, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "an \"image\"?"}]}]}),
        ),
    ];
    for (path, body) in tricky {
        let a = post(&epd.proxy.url(), path, &body.to_string()).await;
        assert_eq!(a.status, 200, "{path}: {}", a.text());
    }
    assert_eq!(epd.encoder_requests(), 0);
    assert_eq!(epd.consumer().stats().requests, 6);
    assert_eq!(epd.proxy.metric("disagg_encode_requests_total").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_and_messages_items_no_encoder_wrote_fail_the_prefill() {
    // The simulated consumer hashes these routes' items itself: sent to it directly,
    // skipping the encoder stage, they fail.
    let epd = Epd::start(false).await;
    let p = epd.prefill.as_ref().unwrap();
    for (path, body) in [
        (RESPONSES, responses(1, false, false)),
        (MESSAGES, messages(1, false)),
    ] {
        let a = post(&p.url(), path, &body).await;
        assert_eq!(a.status, 500, "{path}: {}", a.text());
    }
    assert_eq!(p.stats().ec_items_loaded, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_only_request_never_touches_an_encoder() {
    let epd = Epd::start(false).await;
    for stream in [false, true] {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(0, stream)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    // Even a text that names a media type is text.
    let tricky = json!({"model": "sim-model", "max_tokens": 3,
        "messages": [{"role": "user", "content": "what is an \"image_url\"?"}]});
    let a = post(
        &epd.proxy.url(),
        "/v1/chat/completions",
        &tricky.to_string(),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(epd.encoder_requests(), 0);
    assert_eq!(epd.consumer().stats().requests, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_fails_an_item_no_encoder_wrote() {
    // The simulated consumer really needs the encoders: the same request sent to it
    // directly, skipping the encoder stage, fails.
    let epd = Epd::start(false).await;
    let p = epd.prefill.as_ref().unwrap();
    let a = post(&p.url(), "/v1/chat/completions", &chat(1, false)).await;
    assert_eq!(a.status, 500, "{}", a.text());
    assert_eq!(p.stats().ec_items_loaded, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_encoder_is_replaced_by_the_other() {
    let epd = Epd::start(false).await;
    epd.encoders[0].set_faults(Faults {
        status: Some(503),
        ..Faults::default()
    });
    for _ in 0..4 {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(epd.encoders[0].stats().ec_items_encoded, 0);
    assert_eq!(epd.encoders[1].stats().ec_items_encoded, 4);
    assert_eq!(epd.consumer().stats().ec_items_loaded, 4);
    // The broken encoder was tried, and each of its legs went to the other.
    assert!(epd.encoders[0].stats().requests > 0);
    let retries = epd.proxy.metric("disagg_encode_retries_total").await;
    assert_eq!(retries, epd.encoders[0].stats().requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_encoder_failing_is_a_502_naming_the_encode_stage() {
    let epd = Epd::start(false).await;
    for e in &epd.encoders {
        e.set_faults(Faults {
            status: Some(500),
            ..Faults::default()
        });
    }
    for stream in [false, true] {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(2, stream)).await;
        a.assert_error(502, "encode_failed");
        let message = a.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(message.starts_with("encode endpoint"), "{message}");
    }
    // Nothing reached the prefill or the decode.
    assert_eq!(epd.consumer().stats().requests, 0);
    assert_eq!(epd.decode.stats().requests, 0);
    assert_eq!(epd.proxy.metric("disagg_encode_failures_total").await, 2);
}

/// The `openai` Python client sending an image through the proxy's encoder stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_sends_an_image_through_e_p_d() {
    let epd = Epd::start(false).await;
    let png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
    let body = json!({
        "model": "sim-model",
        "max_tokens": 6,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is in this picture?"},
            {"type": "image_url", "image_url": {"url": png}},
        ]}],
    });
    let expect = reference(&body.to_string()).await;
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/python/openai_image.py");
    let url = epd.proxy.url();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(common::python("the `openai` package"))
            .arg(script)
            .arg(url)
            .arg(expect)
            .output()
    })
    .await
    .unwrap()
    .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python failed:\n{stdout}\n{stderr}\n{}",
        epd.proxy.log()
    );
    assert!(stdout.contains("openai image: 2 checks passed"), "{stdout}");
    // Both requests went E → P → D: one item each, encoded and loaded.
    assert_eq!(epd.encoded(), 2);
    assert_eq!(epd.consumer().stats().ec_items_loaded, 2);
}

fn hang(e: &SimEngine) {
    e.set_faults(Faults {
        hang: true,
        ..Faults::default()
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_encoder_stage_has_a_deadline() {
    let epd = Epd::start_with(false, &["--encode-timeout", "0.3"]).await;
    epd.encoders.iter().for_each(hang);
    let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
    a.assert_error(504, "encode_timeout");
    assert_eq!(epd.consumer().stats().requests, 0);
    // Each encoder was given its share of the budget, then dropped: the encoders saw
    // their clients leave, and the answer names one of them.
    let encoders = &epd.encoders;
    let gone = common::eventually(std::time::Duration::from_secs(5), || {
        encoders.iter().map(|e| e.stats().cancelled).sum::<u64>() == 2
    })
    .await;
    assert!(gone, "the hung encoder legs were not dropped");
    let message = a.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        encoders
            .iter()
            .any(|e| message.contains(&format!("encode endpoint {} ", e.url()))),
        "{message}"
    );
}

/// An encoder that accepts legs and never answers is given up after its share of the
/// stage's budget (half of it, with two tries): the leg goes to the other encoder, the
/// hung one is blamed (passed over, counted failed), and every request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_encoder_is_given_up_in_its_share_retried_elsewhere_and_passed_over() {
    let epd = Epd::start_with(false, &["--encode-timeout", "2"]).await;
    hang(&epd.encoders[0]);
    for _ in 0..4 {
        let sent = std::time::Instant::now();
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert!(sent.elapsed() < std::time::Duration::from_secs(2));
    }
    // Tried once (round robin gives it one of the first two legs), then passed over.
    assert_eq!(epd.encoders[0].stats().requests, 1);
    assert_eq!(epd.encoders[0].stats().ec_items_encoded, 0);
    assert_eq!(epd.encoders[1].stats().ec_items_encoded, 4);
    assert_eq!(epd.consumer().stats().ec_items_loaded, 4);
    assert_eq!(epd.proxy.metric("disagg_encode_retries_total").await, 1);
    assert_eq!(epd.proxy.metric("disagg_encode_failures_total").await, 0);
    assert_eq!(epd.proxy.metric("disagg_encode_ejected").await, 1);
    let text = get(&epd.proxy.url(), "/metrics").await.text();
    let failed = format!(
        "disagg_endpoint_requests_total{{role=\"encode\",endpoint=\"{}\",outcome=\"failed\"}} 1",
        epd.encoders[0].url()
    );
    assert!(text.lines().any(|l| l == failed), "{text}");
    // Its leg was dropped when its share ran out.
    let hung = &epd.encoders[0];
    let gone = common::eventually(std::time::Duration::from_secs(5), || {
        hung.stats().cancelled == 1
    })
    .await;
    assert!(gone, "the hung encoder leg was not dropped");
}

/// A stage that fails names the encoder its leg last failed on: the hung one when the
/// budget ran out there, the other when its error came after the hung one was given up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_stage_names_the_encoder_that_hung() {
    let epd = Epd::start_with(false, &["--encode-timeout", "0.6"]).await;
    hang(&epd.encoders[1]);
    epd.encoders[0].set_faults(Faults {
        status: Some(503),
        ..Faults::default()
    });
    let (broken, hung) = (epd.encoders[0].url(), epd.encoders[1].url());
    let mut seen = Vec::new();
    // Both are passed over after the first request: the second starts at the other.
    for _ in 0..2 {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        let message = a.json()["error"]["message"].as_str().unwrap().to_owned();
        if a.status == 504 {
            a.assert_error(504, "encode_timeout");
            assert!(
                message.starts_with(&format!("encode endpoint {hung} timed out")),
                "{message}"
            );
        } else {
            a.assert_error(502, "encode_failed");
            assert!(
                message.starts_with(&format!("encode endpoint {broken} answered 503")),
                "{message}"
            );
        }
        seen.push(a.status);
    }
    seen.sort_unstable();
    assert_eq!(seen, [502, 504]);
    assert_eq!(epd.encoders[0].stats().requests, 2);
    assert_eq!(epd.encoders[1].stats().requests, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_cancels_its_encoder_legs() {
    let epd = Epd::start(false).await;
    epd.encoders.iter().for_each(hang);
    // Two images over two legs would share one: 9 images make two legs (8 + 1).
    let body = chat(9, true);
    let url = format!("{}/v1/chat/completions", epd.proxy.url());
    let client = tokio::spawn(async move {
        post(&url, "", &body).await;
    });
    // The client leaves once both encoder legs reached their (hung) encoders.
    let encoders = &epd.encoders;
    let sent = common::eventually(std::time::Duration::from_secs(20), || {
        encoders.iter().map(|e| e.stats().requests).sum::<u64>() == 2
    })
    .await;
    assert!(sent, "the encoder legs were not sent");
    client.abort();
    let _ = client.await;
    let gone = common::eventually(std::time::Duration::from_secs(5), || {
        encoders.iter().map(|e| e.stats().cancelled).sum::<u64>() == 2
    })
    .await;
    assert!(gone, "encoder legs outlived their client");
    assert_eq!(epd.consumer().stats().requests, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_and_histograms_tell_the_encoder_stage() {
    let epd = Epd::start_with(false, &["--access-log", "json"]).await;
    let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(3, false)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(0, false)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let proxy = &epd.proxy;
    assert!(
        common::eventually(std::time::Duration::from_secs(5), || {
            proxy.stdout().lines().count() >= 2
        })
        .await,
        "{}",
        proxy.stdout()
    );
    let lines: Vec<Value> = proxy
        .stdout()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let media = &lines[0];
    assert_eq!(media["encode_items"], 3, "{media}");
    assert!(
        media["encode_ms"].as_f64().is_some_and(|ms| ms >= 0.0),
        "{media}"
    );
    let text = &lines[1];
    assert!(
        text["encode_items"].is_null() && text["encode_ms"].is_null(),
        "{text}"
    );
    // One request in each histogram, the items one in the bucket for 3 (le 4).
    let metrics = common::get(&proxy.url(), "/metrics").await.text();
    assert!(
        metrics.contains("disagg_encode_duration_seconds_count 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("disagg_encode_items_per_request_bucket{le=\"2\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("disagg_encode_items_per_request_bucket{le=\"4\"} 1"),
        "{metrics}"
    );
}

/// `disagg-proxy demo --encode`: an image through a simulated encoder, then P → D.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_e_p_d() {
    let out = tokio::task::spawn_blocking(|| {
        std::process::Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
            .args([
                "demo",
                "--encode",
                "--max-tokens",
                "4",
                "--inter-token-ms",
                "1",
            ])
            .args(["--prefill-ms-per-token", "0"])
            .output()
    })
    .await
    .unwrap()
    .expect("the demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("the encoder engine encoded 1 image(s); the prefill engine read 1"),
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_an_encoder_refuses_is_the_clients_400_and_not_retried() {
    let epd = Epd::start(false).await;
    epd.encoders[0].set_faults(Faults {
        status: Some(400),
        ..Faults::default()
    });
    let mut refused = 0;
    for _ in 0..4 {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        if a.status == 400 {
            a.assert_error(400, "invalid_parameter");
            assert_eq!(a.json()["error"]["param"], "messages", "{}", a.text());
            refused += 1;
        } else {
            assert_eq!(a.status, 200, "{}", a.text());
        }
    }
    // Each request the refusing encoder got was answered 400, none sent on elsewhere.
    assert!(refused > 0);
    assert_eq!(refused, epd.encoders[0].stats().requests);
    assert_eq!(epd.proxy.metric("disagg_encode_retries_total").await, 0);
    assert_eq!(epd.consumer().stats().requests, 4 - refused);
}

/// A 4xx that is about the encoder, not the items (429 overloaded here; 408, 404, 401,
/// 403 alike), is its failure, as a 5xx is: the leg goes to the other encoder, the
/// refusing one is passed over, and the client never sees a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encoder_answering_429_is_replaced_by_the_other() {
    let epd = Epd::start(false).await;
    epd.encoders[0].set_faults(Faults {
        status: Some(429),
        ..Faults::default()
    });
    for _ in 0..4 {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    // Tried once, its leg sent on to the other, then passed over.
    assert_eq!(epd.encoders[0].stats().requests, 1);
    assert_eq!(epd.encoders[1].stats().ec_items_encoded, 4);
    assert_eq!(epd.consumer().stats().ec_items_loaded, 4);
    assert_eq!(epd.proxy.metric("disagg_encode_retries_total").await, 1);
    assert_eq!(epd.proxy.metric("disagg_encode_ejected").await, 1);
    let text = get(&epd.proxy.url(), "/metrics").await.text();
    let failed = format!(
        "disagg_endpoint_requests_total{{role=\"encode\",endpoint=\"{}\",outcome=\"failed\"}} 1",
        epd.encoders[0].url()
    );
    assert!(text.lines().any(|l| l == failed), "{text}");
}

/// 413 and 422 refuse the items themselves, as 400 does: the client's 400, not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_an_encoder_finds_too_large_or_unprocessable_are_the_clients_400() {
    for status in [413, 422] {
        let epd = Epd::start(false).await;
        for e in &epd.encoders {
            e.set_faults(Faults {
                status: Some(status),
                ..Faults::default()
            });
        }
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        a.assert_error(400, "invalid_parameter");
        assert_eq!(epd.encoder_requests(), 1, "{status}");
        assert_eq!(epd.proxy.metric("disagg_encode_retries_total").await, 0);
        assert_eq!(epd.proxy.metric("disagg_encode_ejected").await, 0);
    }
}

/// The encoders only ever see ids of the proxy's: a client's `x-request-id`, the same
/// on two requests, never reaches them, and each request's encoder leg carries the id
/// its prefill and decode legs carry, with `-enc0` after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoder_legs_never_carry_the_clients_request_id() {
    let epd = Epd::start(false).await;
    let url = epd.proxy.url();
    let body = chat(1, false);
    let headers = [("x-request-id", "client-id-7")];
    let (a, b) = tokio::join!(
        common::post_with(&url, "/v1/chat/completions", &body, &headers),
        common::post_with(&url, "/v1/chat/completions", &body, &headers),
    );
    for a in [a, b] {
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let mut ids: Vec<String> = epd
        .encoders
        .iter()
        .flat_map(SimEngine::requests)
        .filter_map(|r| r.header("x-request-id").map(str::to_owned))
        .collect();
    assert_eq!(ids.len(), 2);
    let prefill_ids: Vec<String> = epd
        .consumer()
        .requests()
        .iter()
        .filter_map(|r| r.header("x-request-id").map(str::to_owned))
        .collect();
    for id in &ids {
        assert!(!id.contains("client-id-7"), "{id}");
        let base = id.strip_suffix("-enc0").expect("a leg id");
        assert!(
            prefill_ids.iter().any(|p| p == base),
            "{id}: {prefill_ids:?}"
        );
    }
    ids.dedup();
    assert_eq!(ids.len(), 2, "{ids:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_encoder_is_passed_over_until_it_answers_again() {
    let epd = Epd::start(false).await;
    epd.encoders[0].set_faults(Faults {
        status: Some(503),
        ..Faults::default()
    });
    for _ in 0..6 {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    // Tried once at most (its failure passed it over), every item encoded by the other.
    assert!(epd.encoders[0].stats().requests <= 1);
    assert_eq!(epd.encoders[1].stats().ec_items_encoded, 6);
    assert!(epd.proxy.metric("disagg_encode_ejected").await <= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoders_are_weighed_by_the_load_their_own_metrics_report() {
    // With --load-source engine-metrics the proxy reads each encoder's /metrics too:
    // requests another router holds on encoder 0 (never answered: a leg sent there
    // would time out) make it the loaded one, though this proxy has nothing in flight
    // there, and every leg goes to encoder 1.
    let epd = Epd::start_with(
        false,
        &[
            "--load-source",
            "engine-metrics",
            "--engine-metrics-interval",
            "0.1",
            "--encode-timeout",
            "5",
        ],
    )
    .await;
    let busy = &epd.encoders[0];
    busy.set_faults(Faults {
        hang: true,
        ..Faults::default()
    });
    let held: Vec<_> = (0..3)
        .map(|_| {
            let url = busy.url();
            tokio::spawn(async move { post(&url, "/v1/chat/completions", &chat(1, false)).await })
        })
        .collect();
    let line = format!(
        "disagg_engine_requests_running{{endpoint=\"{}\"}} ",
        busy.url()
    );
    let read = within_5s(|| {
        let (proxy, line) = (epd.proxy.url(), line.clone());
        async move {
            let text = get(&proxy, "/metrics").await.text();
            text.lines()
                .filter_map(|l| l.strip_prefix(&line)?.trim().parse::<f64>().ok())
                .any(|v| v >= 3.0)
        }
    })
    .await;
    assert!(read, "the proxy never read the encoder's own load");
    for _ in 0..6 {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(epd.encoders[1].stats().ec_items_encoded, 6);
    assert_eq!(busy.stats().ec_items_encoded, 0);
    for h in held {
        h.abort();
    }
}

// === encoders as endpoints: discovery, health, metrics, pairing, SGLang ===

/// Polls `f` every 50 ms for up to 5 s.
async fn within_5s<F: std::future::Future<Output = bool>>(mut f: impl FnMut() -> F) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < std::time::Duration::from_secs(5) {
        if f().await {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    f().await
}

/// Replaces `path` as editors and ConfigMap volumes do: a new file renamed over it.
fn replace(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn endpoints(prefill: &SimEngine, decode: &SimEngine, encoders: &[&SimEngine]) -> String {
    let mut text = format!(
        "[[prefill]]\nurl = \"{}\"\n[[decode]]\nurl = \"{}\"\n",
        prefill.url(),
        decode.url()
    );
    for e in encoders {
        text.push_str(&format!("[[encode]]\nurl = \"{}\"\n", e.url()));
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encoder_added_to_the_endpoints_file_at_run_time_receives_legs() {
    let store = TempDir::new();
    let e1 = engine(Some((EcRole::Producer, &store))).await;
    let e2 = engine(Some((EcRole::Producer, &store))).await;
    let p = engine(Some((EcRole::Consumer, &store))).await;
    let d = engine(None).await;
    let dir = TempDir::new();
    std::fs::create_dir_all(&dir.0).unwrap();
    let path = dir.0.join("endpoints.toml");
    replace(&path, &endpoints(&p, &d, &[&e1]));
    let proxy =
        Proxy::start_args(&["--endpoints-file".to_owned(), path.display().to_string()]).await;
    for _ in 0..2 {
        let a = post(&proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
    }
    assert_eq!((e1.stats().requests, e2.stats().requests), (2, 0));
    // A second encoder joins: it is given legs.
    replace(&path, &endpoints(&p, &d, &[&e1, &e2]));
    let e2_url = e2.url();
    assert!(
        within_5s(|| proxy.routes_to("encode", &e2_url)).await,
        "{}",
        proxy.log()
    );
    for _ in 0..4 {
        let a = post(&proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert!(e2.stats().ec_items_encoded > 0, "{}", proxy.log());
    // The first leaves: nothing more for it.
    replace(&path, &endpoints(&p, &d, &[&e2]));
    let e1_url = e1.url();
    assert!(within_5s(|| async { !proxy.routes_to("encode", &e1_url).await }).await);
    let before = e1.stats().requests;
    for _ in 0..3 {
        let a = post(&proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(e1.stats().requests, before);
    // Every item was encoded before its prefill read it.
    assert_eq!(p.stats().ec_items_loaded, 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encoder_failing_health_checks_is_given_no_legs_and_comes_back() {
    let epd = Epd::start_with(false, &["--health-check-interval", "0.1"]).await;
    let (sick, well) = (&epd.encoders[0], &epd.encoders[1]);
    let sick_url = sick.url();
    assert!(epd.proxy.routes_to("encode", &sick_url).await);
    // SGLang's encoder answers 503 on /health when its dummy encode fails.
    sick.set_faults(Faults {
        health_status: Some(503),
        ..Faults::default()
    });
    assert!(
        within_5s(|| async { !epd.proxy.routes_to("encode", &sick_url).await }).await,
        "{}",
        epd.proxy.log()
    );
    let before = sick.stats().requests;
    for _ in 0..4 {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(
        sick.stats().requests,
        before,
        "an unhealthy encoder got a leg"
    );
    assert!(well.stats().ec_items_encoded >= 4);
    let health = get(&epd.proxy.url(), "/metrics").await.text();
    let down = format!(
        "disagg_endpoint_health{{role=\"encode\",endpoint=\"{}\",state=\"down\"}} 1",
        sick.url()
    );
    assert!(health.contains(&down), "{health}");
    // Healthy again: back in the set, and given legs.
    sick.set_faults(Faults::default());
    assert!(within_5s(|| epd.proxy.routes_to("encode", &sick_url)).await);
    for _ in 0..4 {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert!(sick.stats().requests > before, "{}", epd.proxy.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoder_legs_are_counted_per_endpoint_with_role_encode() {
    let epd = Epd::start(false).await;
    epd.encoders[1].set_faults(Faults {
        status: Some(500),
        ..Faults::default()
    });
    for _ in 0..4 {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let text = get(&epd.proxy.url(), "/metrics").await.text();
    let count = |url: &str, outcome: &str| {
        let line = format!(
            "disagg_endpoint_requests_total{{role=\"encode\",endpoint=\"{url}\",outcome=\"{outcome}\"}} "
        );
        text.lines()
            .find_map(|l| l.strip_prefix(&line)?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let (good, bad) = (epd.encoders[0].url(), epd.encoders[1].url());
    assert_eq!(count(&good, "answered"), 4, "{text}");
    assert_eq!(
        count(&bad, "failed"),
        epd.encoders[1].stats().requests,
        "{text}"
    );
    assert!(count(&bad, "failed") >= 1, "{text}");
    for e in &epd.encoders {
        let gauge = format!(
            "disagg_endpoint_in_flight{{role=\"encode\",endpoint=\"{}\"}}",
            e.url()
        );
        let health = format!(
            "disagg_endpoint_health{{role=\"encode\",endpoint=\"{}\"",
            e.url()
        );
        assert!(text.contains(&gauge) || e.url() == bad, "{text}");
        assert!(text.contains(&health), "{text}");
    }
}

#[test]
fn an_encoder_pool_its_consumer_cannot_load_is_refused_at_start() {
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let out = run(&[
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
        "--encode",
        "http://127.0.0.1:3",
        "--ec-profile",
        "http://127.0.0.1:3=ECMooncakeConnector,ec_producer",
        "--ec-profile",
        "http://127.0.0.1:1=ECExampleConnector,ec_consumer",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("encoder endpoint http://127.0.0.1:3")
            && err.contains("prefill endpoint http://127.0.0.1:1")
            && err.contains("ECMooncakeConnector"),
        "{err}"
    );
    // E -> PD: the decode is the consumer; a producer-only one cannot load.
    let out = run(&[
        "--decode",
        "http://127.0.0.1:2",
        "--encode",
        "http://127.0.0.1:3",
        "--ec-profile",
        "http://127.0.0.1:2=cpu,ec_producer",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("decode endpoint http://127.0.0.1:2") && err.contains("cannot consume"),
        "{err}"
    );
    // A profile for no engine given is refused too.
    let out = run(&[
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
        "--ec-profile",
        "http://127.0.0.1:9=cpu,ec_producer",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--ec-profile names http://127.0.0.1:9"),
        "{err}"
    );
}

/// SGLang E/P/D: the language-only prefill calls its encoders itself; the proxy knows
/// the encoders (`--encode`) for their health and metrics only and sends them nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sglang_an_encoder_is_health_checked_but_sent_nothing() {
    use disagg_sim::{KvMode, SimRole};
    let sglang = |role| {
        SimEngine::start(SimConfig {
            kv_mode: KvMode::Sglang(role),
            ..SimConfig::default()
        })
    };
    let p = sglang(SimRole::Prefill).await.unwrap();
    let d = sglang(SimRole::Decode).await.unwrap();
    let e = SimEngine::start(SimConfig::default()).await.unwrap();
    let port = p.bootstrap_addr().expect("a bootstrap server").port();
    let proxy = Proxy::start_args(&[
        "--connector".to_owned(),
        "sglang".to_owned(),
        "--prefill".to_owned(),
        p.url(),
        port.to_string(),
        "--decode".to_owned(),
        d.url(),
        "--encode".to_owned(),
        e.url(),
        "--health-check-interval".to_owned(),
        "0.1".to_owned(),
    ])
    .await;
    for stream in [false, true] {
        let a = post(&proxy.url(), "/v1/chat/completions", &chat(2, stream)).await;
        assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
    }
    assert_eq!((p.stats().requests, d.stats().requests), (2, 2));
    // Probed: its /health is asked, and it is listed with role="encode".
    assert!(
        common::eventually(std::time::Duration::from_secs(5), || {
            e.received().iter().any(|r| r.path == "/health")
        })
        .await
    );
    assert!(proxy.routes_to("encode", &e.url()).await);
    // Sent nothing else: no leg, no request on any other route.
    assert_eq!(e.stats().requests, 0);
    assert!(
        e.received().iter().all(|r| r.path == "/health"),
        "{:?}",
        e.received()
    );
    // Its health counts: failing checks take it out.
    e.set_faults(Faults {
        health_status: Some(503),
        ..Faults::default()
    });
    let e_url = e.url();
    assert!(within_5s(|| async { !proxy.routes_to("encode", &e_url).await }).await);
}

// === A decode-only fallback after the encoder stage ===

/// E → P → D with placeholders on and `--prefill-failure decode-only`: the prefill is
/// down after the encoders answered, and the decode that serves alone loads no encoder
/// output, so it gets the client's media (and no encoder fields), not placeholders it
/// could never resolve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_only_fallback_to_a_decode_that_loads_nothing_gets_the_media() {
    let store = TempDir::new();
    let encoder = engine(Some((EcRole::Producer, &store))).await;
    let decode = engine(None).await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        format!("http://{}", l.local_addr().expect("its address"))
    };
    let url = decode.url();
    let args = [
        "--prefill",
        &dead,
        "--decode",
        &url,
        "--encode",
        &encoder.url(),
        "--encode-placeholders",
        "--prefill-failure",
        "decode-only",
    ]
    .map(str::to_owned);
    let proxy = Proxy::start_args(&args).await;
    for stream in [false, true] {
        let body = chat(2, stream);
        let a = post(&proxy.url(), "/v1/chat/completions", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("decode-only"));
        assert_eq!(a.chat_content(), reference(&body).await);
        let leg = decode.requests().pop().expect("the decode served it");
        assert!(leg.body.get("ec_transfer_params").is_none(), "{}", leg.body);
        let content = leg.body["messages"][0]["content"].as_array().unwrap();
        for (n, part) in content[1..].iter().enumerate() {
            assert_eq!(part, &image(n), "the client's item, as sent");
        }
    }
    // The stage did run (the prefill was the consumer it planned for).
    assert_eq!(encoder.stats().ec_items_encoded, 4);
}
