//! Encoder disaggregation (E/P/D), as vLLM 0.33 runs it with its shared-storage EC
//! connector (`vllm/distributed/ec_transfer/ec_connector/example_connector.py`): an
//! encoder-only engine (`ec_role: ec_producer`) encodes a chat request's media items,
//! writes each item's "embeddings" under its identifier in a directory it shares with the
//! prefill, and answers with `ec_transfer_params` keyed by identifier
//! (`ec_connector/utils.py`, `collect_ec_item_metadata`); a consumer (`ec_consumer`)
//! reads every media item of its requests from that directory.
//!
//! An item's identifier is its `uuid` when the request names one (chat only: vLLM's
//! Responses and Messages request models keep no per-item `uuid`) and carries no
//! processor kwargs (with them, a hash of the `uuid` and the kwargs), else a hash of its
//! media (the URL or data it is loaded from, whatever part shape carried it) and of the
//! processor kwargs its route passes on (chat: `mm_processor_kwargs` and
//! `media_io_kwargs`; Responses: `mm_processor_kwargs`; Messages: none). A consumer reads
//! the items of chat `messages`, of the Responses API's `input` (`input_image`,
//! `input_audio`) and of the Messages API's `messages` (`image` blocks, also inside a
//! user's `tool_result`), as vLLM converts them to chat (`vllm/entrypoints/chat_utils.py`,
//! `vllm/entrypoints/openai/responses/utils.py`, `vllm/entrypoints/anthropic/serving.py`).
//! A consumer that finds an item missing (its encoder was skipped, or was told another
//! identifier) fails the request with 500: the simulated prefill has no encoder of its
//! own, so a wrong orchestration really fails. The same holds for an embeddings
//! placeholder (`image_embeds`, `audio_embeds` or `video_embeds` parts with no data, as vLLM takes them
//! with `--enable-mm-embeds`): it is read from the store under its `uuid`, so one whose
//! embeddings no encoder wrote fails; and, as vLLM, a request mixing raw and embedded
//! items of one modality is refused (400).

use std::path::{Path, PathBuf};

use http::StatusCode;
use serde_json::{Map, Value, json};

use crate::api::ApiError;

/// The engine's part in encoder disaggregation (vLLM's `ec_role`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EcRole {
    /// `ec_producer`: an encoder-only engine; every chat request is an encoder leg.
    Producer,
    /// `ec_consumer`: a prefill (or prefill-decode) engine reading the encoders' output.
    Consumer,
}

/// Encoder disaggregation settings ([`SimConfig::ec`](crate::SimConfig::ec)).
#[derive(Clone, Debug)]
pub struct EcConfig {
    /// The engine's role.
    pub role: EcRole,
    /// The directory shared by the encoders and their consumers (vLLM's
    /// `ec_connector_extra_config.shared_storage_path`).
    pub store: PathBuf,
}

/// Longest item identifier taken from a request (it names a directory).
const MAX_ID: usize = 128;

/// Most media items one request may carry.
const MAX_ITEMS: usize = 256;

/// The bytes the simulated encoder writes for an item, and the consumer checks.
pub(crate) fn embeddings(id: &str) -> Vec<u8> {
    format!("sim-embeddings:{id}").into_bytes()
}

/// The modality of a content part's type, for the media types vLLM's chat API takes.
fn modality(ty: &str) -> Option<&'static str> {
    match ty {
        "image_url" | "image_embeds" => Some("image"),
        "input_audio" | "audio_url" | "audio_embeds" => Some("audio"),
        "video_url" | "video_embeds" => Some("video"),
        _ => None,
    }
}

/// The route a request came by, for reading its media items.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EcApi {
    /// `/v1/chat/completions`: `messages`, per-item `uuid` honoured.
    Chat,
    /// `/v1/responses`: `input`.
    Responses,
    /// `/v1/messages`: Anthropic `messages`.
    Messages,
}

/// FNV-1a over an item's modality, its media and the request's processor kwargs, as 16
/// hex digits.
fn content_hash(modality: &str, media: &str, kwargs: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(modality.as_bytes());
    eat(&[0]);
    eat(media.as_bytes());
    eat(&[0]);
    eat(kwargs);
    format!("{h:016x}")
}

/// The kwargs `api` passes to the processor, as bytes folded into a content hash.
fn kwargs(api: EcApi, body: &Value) -> Vec<u8> {
    let keys: &[&str] = match api {
        EcApi::Chat => &["mm_processor_kwargs", "media_io_kwargs"],
        EcApi::Responses => &["mm_processor_kwargs"],
        EcApi::Messages => &[],
    };
    let mut out = Vec::new();
    for key in keys {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(&serde_json::to_vec(v).unwrap_or_default());
        }
    }
    out
}

/// A URL field that is either the URL or `{"url": URL}`.
fn url_of(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v
            .get("url")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        None => String::new(),
    }
}

/// An `input_audio` value as the data URL vLLM loads it from.
fn audio_url(v: Option<&Value>) -> String {
    let field = |k| {
        v.and_then(|v| v.get(k))
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    format!("data:audio/{};base64,{}", field("format"), field("data"))
}

/// An Anthropic image source as the URL vLLM makes of it (`anthropic/serving.py`,
/// `_convert_image_source_to_url`).
pub(crate) fn anthropic_image_url(source: &Value) -> String {
    let field = |k, default: &str| {
        source
            .get(k)
            .and_then(Value::as_str)
            .unwrap_or(default)
            .to_owned()
    };
    if source.get("type").and_then(Value::as_str) == Some("url") {
        return field("url", "");
    }
    format!(
        "data:{};base64,{}",
        field("media_type", "image/jpeg"),
        field("data", "")
    )
}

/// One media part of a chat message: its modality and the media it is loaded from.
fn chat_media(obj: &Map<String, Value>) -> Option<(&'static str, String)> {
    let ty = obj.get("type").and_then(Value::as_str)?;
    let m = modality(ty)?;
    let media = match ty {
        "image_url" | "audio_url" | "video_url" => url_of(obj.get(ty)),
        "input_audio" => audio_url(obj.get(ty)),
        _ => serde_json::to_string(&obj.get(ty)).unwrap_or_default(),
    };
    Some((m, media))
}

/// A chat part's own `uuid`, checked (it names a directory of the store).
fn part_uuid(obj: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    match obj.get("uuid") {
        Some(Value::String(u)) if !u.is_empty() => {
            let safe = u.len() <= MAX_ID
                && u.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !safe {
                return Err(ApiError::bad_request(
                    "uuid: letters, digits, '-' and '_' only, at most 128",
                ));
            }
            Ok(Some(u.clone()))
        }
        _ => Ok(None),
    }
}

/// A turn's `role`, `""` when it has none.
fn role(turn: &Value) -> &str {
    turn.get("role").and_then(Value::as_str).unwrap_or_default()
}

/// The elements of `v` when it is an array.
fn list(v: Option<&Value>) -> &[Value] {
    match v {
        Some(Value::Array(items)) => items,
        _ => &[],
    }
}

/// Each media item of a body that came by `api`, in order: its identifier and modality.
pub(crate) fn items(api: EcApi, body: &Value) -> Result<Vec<(String, &'static str)>, ApiError> {
    // (modality, media, the part's own uuid where the route honours one)
    let mut found: Vec<(&'static str, String, Option<String>)> = Vec::new();
    let mut push = |m: &'static str, media: String, uuid: Option<String>| {
        if found.len() >= MAX_ITEMS {
            return Err(ApiError::bad_request("too many multimodal items"));
        }
        found.push((m, media, uuid));
        Ok(())
    };
    match api {
        EcApi::Chat => {
            // vLLM refuses raw and embedded items of one modality in one request
            // (`chat_utils.py`, `_resolve_items`).
            let (mut raw, mut embedded) = (Vec::new(), Vec::new());
            for turn in list(body.get("messages")) {
                for part in list(turn.get("content")) {
                    let Some(obj) = part.as_object() else {
                        continue;
                    };
                    if let Some((m, media)) = chat_media(obj) {
                        let ty = obj.get("type").and_then(Value::as_str).unwrap_or_default();
                        if ty.ends_with("_embeds") {
                            embedded.push(m);
                        } else {
                            raw.push(m);
                        }
                        push(m, media, part_uuid(obj)?)?;
                    }
                }
            }
            if let Some(m) = raw.iter().find(|m| embedded.contains(m)) {
                return Err(ApiError::bad_request(format!(
                    "Mixing raw {m} and embedding inputs is not allowed"
                )));
            }
        }
        EcApi::Responses => {
            for turn in list(body.get("input")) {
                let ty = turn.get("type").and_then(Value::as_str);
                if ty.is_some_and(|t| t != "message") || role(turn) == "assistant" {
                    continue;
                }
                for part in list(turn.get("content")) {
                    match part.get("type").and_then(Value::as_str) {
                        Some("input_image") => {
                            if let Some(url) = part.get("image_url").and_then(Value::as_str) {
                                push("image", url.to_owned(), None)?;
                            }
                        }
                        Some("input_audio") => {
                            push("audio", audio_url(part.get("input_audio")), None)?;
                        }
                        _ => {}
                    }
                }
            }
        }
        EcApi::Messages => {
            for turn in list(body.get("messages")) {
                if role(turn) == "system" {
                    continue;
                }
                let user = role(turn) == "user";
                for block in list(turn.get("content")) {
                    match block.get("type").and_then(Value::as_str) {
                        Some("image") => {
                            if let Some(source) = block.get("source") {
                                push("image", anthropic_image_url(source), None)?;
                            }
                        }
                        Some("tool_result") if user => {
                            for inner in list(block.get("content")) {
                                if inner.get("type").and_then(Value::as_str) == Some("image")
                                    && let Some(source) = inner.get("source")
                                {
                                    push("image", anthropic_image_url(source), None)?;
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    let kwargs = kwargs(api, body);
    // A client's uuid names the item only when the request has no processor kwargs:
    // vLLM hashes the uuid with them otherwise (`vllm/multimodal/processing/inputs.py`,
    // `get_mm_hashes`), since the encoder output depends on them.
    let id = |m: &str, media: String, uuid: Option<String>| match uuid {
        Some(u) if kwargs.is_empty() => u,
        Some(u) => content_hash(m, &format!("uuid:{u}"), &kwargs),
        None => content_hash(m, &media, &kwargs),
    };
    Ok(found
        .into_iter()
        .map(|(m, media, uuid)| (id(m, media, uuid), m))
        .collect())
}

fn item_path(store: &Path, id: &str) -> PathBuf {
    store.join(id).join("encoder_cache.bin")
}

/// An encoder leg: every item encoded into the store; the answer's
/// `ec_transfer_params` (keyed by identifier, each `{modality, item_indices, metadata}`).
pub(crate) fn encode(store: &Path, body: &Value) -> Result<(Value, usize), ApiError> {
    let items = items(EcApi::Chat, body)?;
    for (id, _) in &items {
        let path = item_path(store, id);
        // Written aside and renamed into place: a consumer reading the item while
        // another leg writes the same item (the same media, in concurrent requests)
        // sees the old whole file or the new one, never a truncated one. The write is
        // synchronous, so no other write runs on this thread meanwhile.
        let aside = path.with_extension(format!("{:?}", std::thread::current().id()));
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&aside, embeddings(id)))
            .and_then(|()| std::fs::rename(&aside, &path));
        if let Err(e) = written {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot save the encoder cache of {id}: {e}"),
            ));
        }
    }
    Ok((answer_params(&items), items.len()))
}

/// An encoder's answer `ec_transfer_params` for its leg's `items` (identifier and
/// modality, in order): keyed by identifier, each `{modality, item_indices, metadata}`.
pub(crate) fn answer_params(items: &[(String, &'static str)]) -> Value {
    let mut params = Map::new();
    for (index, (id, m)) in items.iter().enumerate() {
        let entry = params
            .entry(id.clone())
            .or_insert_with(|| json!({"modality": m, "item_indices": [], "metadata": {}}));
        if let Some(Value::Array(indices)) = entry.get_mut("item_indices") {
            indices.push(Value::from(index));
        }
    }
    Value::Object(params)
}

/// A consumer's request (by `api`): every media item read from the store. How many were
/// read.
pub(crate) fn load(store: &Path, api: EcApi, body: &Value) -> Result<usize, ApiError> {
    let items = items(api, body)?;
    for (id, _) in &items {
        match std::fs::read(item_path(store, id)) {
            Ok(bytes) if bytes == embeddings(id) => {}
            Ok(_) => {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the encoder cache of item {id} is corrupt"),
                ));
            }
            Err(_) => {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!(
                        "no encoder cache for multimodal item {id}: this engine has no encoder"
                    ),
                ));
            }
        }
    }
    Ok(items.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "disagg-sim-ec-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_consumer_reads_what_the_encoder_wrote_and_nothing_else() {
        let store = temp();
        let img = |u: &str| json!({"type": "image_url", "image_url": {"url": u}, "uuid": u});
        let body =
            json!({"messages": [{"role": "user", "content": [img("a"), img("b"), img("a")]}]});
        let (params, n) = encode(&store, &body).unwrap();
        assert_eq!(n, 3);
        assert_eq!(params["a"]["item_indices"], json!([0, 2]));
        assert_eq!(params["b"]["modality"], "image");
        assert_eq!(load(&store, EcApi::Chat, &body).unwrap(), 3);
        let other = json!({"messages": [{"role": "user", "content": [img("c")]}]});
        assert_eq!(
            load(&store, EcApi::Chat, &other).unwrap_err().status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
        let escape = json!({"messages": [{"role": "user", "content": [img("../x")]}]});
        assert_eq!(
            encode(&store, &escape).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        std::fs::remove_dir_all(store).unwrap();
    }

    #[test]
    fn an_item_read_while_another_leg_writes_it_is_whole() {
        // Concurrent requests with the same media write the same item: a consumer
        // reading it meanwhile must find the whole file (it once found it truncated).
        let store = temp();
        let img = json!({"type": "image_url", "image_url": {"url": "data:,x"}, "uuid": "same"});
        let body = json!({"messages": [{"role": "user", "content": [img]}]});
        encode(&store, &body).unwrap();
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..500 {
                        encode(&store, &body).unwrap();
                    }
                });
            }
            s.spawn(|| {
                for _ in 0..1000 {
                    assert_eq!(load(&store, EcApi::Chat, &body).unwrap(), 1);
                }
            });
        });
        std::fs::remove_dir_all(store).unwrap();
    }

    #[test]
    fn a_uuid_names_its_item_only_without_processor_kwargs() {
        let img = json!({"type": "image_url", "image_url": {"url": "data:,x"}, "uuid": "u1"});
        let body = |kwargs: Value| {
            let mut b = json!({"messages": [{"role": "user", "content": [img.clone()]}]});
            if !kwargs.is_null() {
                b["mm_processor_kwargs"] = kwargs;
            }
            items(EcApi::Chat, &b).unwrap()[0].0.clone()
        };
        assert_eq!(body(Value::Null), "u1");
        let hashed = body(json!({"max_pixels": 1024}));
        assert_ne!(hashed, "u1");
        assert_eq!(hashed, body(json!({"max_pixels": 1024})));
        assert_ne!(hashed, body(json!({"max_pixels": 2048})));
    }

    #[test]
    fn an_image_hashes_alike_whatever_route_carried_it_and_only_chat_keeps_a_uuid() {
        let url = "data:image/png;base64,QUJD";
        let id = |api, body: Value| items(api, &body).unwrap()[0].0.clone();
        let chat = id(
            EcApi::Chat,
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}]}),
        );
        let responses = id(
            EcApi::Responses,
            json!({"input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": url, "uuid": "ignored"}]}]}),
        );
        let messages = id(
            EcApi::Messages,
            json!({"messages": [{"role": "user", "content": [
                {"type": "image", "uuid": "ignored",
                 "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}]}]}),
        );
        assert_eq!(chat, responses);
        assert_eq!(chat, messages);
        // The processor kwargs a route passes on are part of the name; Messages has none.
        let with_kwargs = id(
            EcApi::Responses,
            json!({"mm_processor_kwargs": {"x": 1}, "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": url}]}]}),
        );
        assert_ne!(with_kwargs, chat);
        let messages_kwargs = id(
            EcApi::Messages,
            json!({"mm_processor_kwargs": {"x": 1}, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": url}}]}]}),
        );
        assert_eq!(messages_kwargs, chat);
        // Assistant input and system messages carry no items.
        let none = json!({"input": [{"role": "assistant", "content": [
            {"type": "input_image", "image_url": url}]}]});
        assert!(items(EcApi::Responses, &none).unwrap().is_empty());
    }

    #[test]
    fn a_placeholder_is_read_by_its_uuid_and_never_mixed_with_raw_items() {
        let store = temp();
        let img = |u: &str| json!({"type": "image_url", "image_url": {"url": u}, "uuid": u});
        let embeds = |u: &str| json!({"type": "image_embeds", "image_embeds": null, "uuid": u});
        let chat = |parts: Vec<Value>| json!({"messages": [{"role": "user", "content": parts}]});
        encode(&store, &chat(vec![img("a"), img("b")])).unwrap();
        assert_eq!(
            load(&store, EcApi::Chat, &chat(vec![embeds("a"), embeds("b")])).unwrap(),
            2
        );
        // Embeddings no encoder wrote: the consumer has nothing to read.
        let missing = chat(vec![embeds("c")]);
        assert_eq!(
            load(&store, EcApi::Chat, &missing).unwrap_err().status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
        let mixed = chat(vec![img("a"), embeds("b")]);
        assert_eq!(
            load(&store, EcApi::Chat, &mixed).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        let audio = json!({"type": "input_audio", "input_audio": {"data": "x", "format": "wav"},
                           "uuid": "a"});
        assert_eq!(
            load(&store, EcApi::Chat, &chat(vec![audio, embeds("b")])).unwrap(),
            2
        );
        std::fs::remove_dir_all(store).unwrap();
    }
}
