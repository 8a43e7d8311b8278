//! vLLM 0.33's encoder disaggregation (E/P/D), on the proxy's side: the encoder legs
//! of a multimodal chat, Responses or Messages request, and the `ec_transfer_params`
//! their answers give the prefill.
//!
//! The facts, from vLLM's own code (paths relative to the `vllm` package): a request may
//! carry a top-level `ec_transfer_params` object (`entrypoints/openai/chat_completion/protocol.py`);
//! an encoder (`ec_role: ec_producer`) answers a non-streamed request with a top-level
//! `ec_transfer_params` keyed by each item's identifier, `{modality, item_indices,
//! metadata}` (`distributed/ec_transfer/ec_connector/utils.py`,
//! `collect_ec_item_metadata`); the identifier is the item's content hash unless the
//! request names the item's `uuid`. docs/connectors.md has the whole protocol.

use bytes::Bytes;
use disagg_core::encode::{EncodeLeg, EncodePlan, EncoderConnector};
use disagg_core::error::ConnectorError;
use disagg_core::request::{Api, PdRequest};
use disagg_json::{BodyError, InvalidParam};
use serde_json::value::RawValue;
use std::collections::BTreeMap;

use disagg_json::raw as json;

mod chat;
mod convert;
mod push;

pub use push::{DEFAULT_EC_HOST, DEFAULT_EC_PORT, MooncakeEcPush};

/// Request fields the encoder legs carry as the client sent them: they change what the
/// encoder computes (and vLLM folds them into the item's identifier).
const COPIED: &[&str] = &["mm_processor_kwargs", "media_io_kwargs"];

/// Most media items one request may carry through the encoder stage: each is a leg's
/// work and an entry of the merged answer.
const MAX_ITEMS: usize = 256;

/// Most entries the merged `ec_transfer_params` may hold (a peer's answer is bounded by
/// the stage's byte ceiling too).
const MAX_ENTRIES: usize = 4096;

/// Longest one entry of an encoder's `ec_transfer_params` may be, as written: vLLM's
/// are `{modality, item_indices, metadata}` of a few placeholder fields (hundreds of
/// bytes). Bounds what a placeholder copies of its entry's `metadata`, up to
/// [`MAX_ITEMS`] times.
const MAX_ENTRY_BYTES: usize = 64 * 1024;

/// vLLM's encoder protocol, for [`EncodeStage`](disagg_core::encode::EncodeStage).
///
/// Chat: each media item of the client's `messages` gets an explicit `uuid` derived from
/// its content and the request's `mm_processor_kwargs` / `media_io_kwargs` (a `uuid` the
/// client gave is kept), so the encoder and the prefill name the item alike whatever
/// their caches. Responses (`input`) and Messages (`messages`): vLLM hands no per-item
/// `uuid` to the processor on those routes, so the prefill names each item by its
/// content hash; the encoder legs carry the item as the chat part vLLM converts it to,
/// without a `uuid`, and the kwargs that route passes to the processor (Responses:
/// `mm_processor_kwargs`; Messages: none), so that the encoder hashes it alike.
///
/// The encoder legs are chat requests (what vLLM's encoder serves) carrying the items
/// only (`max_tokens: 1`, not streamed, since vLLM writes `ec_transfer_params` only into
/// a whole answer); images share a leg up to [`with_image_batch`](Self::with_image_batch),
/// audio and video go one per leg.
#[derive(Debug, Clone)]
pub struct VllmEncoder {
    image_batch: usize,
    placeholders: bool,
    /// Mooncake EC (push): the consumer is named to the encoders.
    push: Option<std::sync::Arc<MooncakeEcPush>>,
}

impl Default for VllmEncoder {
    fn default() -> Self {
        VllmEncoder {
            image_batch: 8,
            placeholders: false,
            push: None,
        }
    }
}

impl VllmEncoder {
    /// The protocol with its defaults (up to 8 images per leg).
    pub fn new() -> Self {
        Self::default()
    }

    /// At most `n` images per encoder leg (at least 1).
    pub fn with_image_batch(mut self, n: usize) -> Self {
        self.image_batch = n.max(1);
        self
    }

    /// With `on`, a chat request's image and audio items whose embeddings an encoder
    /// handed over reach the prefill and decode as vLLM's embeddings placeholder parts
    /// instead of their media (off by default: the engines need `--enable-mm-embeds`).
    ///
    /// An item becomes `{"type": "<modality>_embeds", "<modality>_embeds": M, "uuid":
    /// U}`, `U` its uuid and `M` the `metadata` of its `ec_transfer_params` entry (the
    /// placeholder fields the model needs; `null` when empty). vLLM's chat parser reads
    /// such a part as pre-computed embeddings named by `U`, which its EC connector
    /// supplies (`vllm/renderers/chat_utils/`: with a `uuid`, the
    /// `<modality>_embeds` key must be present). It refuses a request mixing raw and
    /// embedded items of one modality (`_resolve_items`), so a modality is rewritten
    /// only when every item of it has an entry; video items, and items of requests on
    /// other routes (whose request models take no such part), keep their media.
    pub fn with_embeds_placeholders(mut self, on: bool) -> Self {
        self.placeholders = on;
        self
    }

    /// For vLLM's Mooncake EC connector (push, `ECMooncakeConnector`): the request is
    /// routed first, each encoder leg names the chosen consumer's address (`push`'s,
    /// for its data-parallel rank) and a transfer id per item, and the consumer leg
    /// names each item's hash and transfer id (see the `push` module).
    pub fn with_mooncake_push(mut self, push: MooncakeEcPush) -> Self {
        self.push = Some(std::sync::Arc::new(push));
        self
    }
}

/// The content-derived id of one item: a 128-bit hash of its part's fields (sorted,
/// `uuid` left out, each value as `serde_json` writes it once parsed, so spacing and
/// escapes do not matter) and the copied kwargs as the client wrote them, as 32 hex
/// digits.
fn item_uuid(part: &chat::MediaPart<'_>, kwargs: &[u8]) -> Result<String, InvalidParam> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for (k, v) in &part.fields {
        if k == "uuid" {
            continue;
        }
        h.update(k.as_bytes());
        h.update(&[0]);
        chat::canonical(v, &mut |b| h.update(b)).map_err(|e| {
            let problem = if e.is_data() {
                "nests a media part's values too deeply"
            } else {
                "is not valid JSON"
            };
            InvalidParam::new("messages", problem)
        })?;
        h.update(&[0]);
    }
    h.update(kwargs);
    Ok(format!("{:032x}", h.digest128()))
}

impl EncoderConnector for VllmEncoder {
    fn name(&self) -> &'static str {
        "vllm-encoder"
    }

    fn plan(&self, req: &PdRequest) -> Result<Option<EncodePlan>, InvalidParam> {
        let body = req.body();
        let items = match req.api() {
            Api::Chat => return self.plan_chat(req),
            Api::Responses => match body.get("input") {
                Some(input) => convert::responses(input, MAX_ITEMS)?,
                None => return Ok(None),
            },
            Api::Messages => match body.get("messages") {
                Some(messages) => convert::messages(messages, MAX_ITEMS)?,
                None => return Ok(None),
            },
            _ => return Ok(None),
        };
        // vLLM's Responses request takes `mm_processor_kwargs` (no `media_io_kwargs`);
        // its Messages request neither.
        let copied: &[&str] = match req.api() {
            Api::Responses => &["mm_processor_kwargs"],
            _ => &[],
        };
        let copied: Vec<(&str, &[u8])> = copied
            .iter()
            .filter_map(|k| body.get(k).filter(|v| *v != b"null").map(|v| (*k, v)))
            .collect();
        let model = body.get("model");
        let legs = group(
            items.iter().map(|item| {
                let leg = LegPart {
                    raw: &item.part,
                    uuid: None,
                };
                (leg, item.batched)
            }),
            self.image_batch,
        );
        if legs.is_empty() {
            return Ok(None);
        }
        let legs = encode_legs(model, &legs, &copied);
        // The client's items stay as they are on the legs that follow: the prefill
        // hashes them as the encoders did.
        Ok(Some(EncodePlan {
            legs,
            fields: Vec::new(),
            rank: None,
        }))
    }

    fn consumer_first(&self) -> bool {
        self.push.is_some()
    }

    /// A decode consumes when it declares an EC profile of role `ec_consumer` or
    /// `ec_both` (vLLM `config/ec_transfer.py`: such an engine loads encoder outputs).
    fn consumes(&self, decode: &disagg_core::Endpoint) -> bool {
        decode
            .ext()
            .get::<disagg_pairing::EcProfile>()
            .and_then(|p| p.role)
            .is_some_and(|r| {
                matches!(
                    r,
                    disagg_pairing::EcRole::Consumer | disagg_pairing::EcRole::Both
                )
            })
    }

    fn plan_for(
        &self,
        req: &PdRequest,
        consumer: &disagg_core::Endpoint,
        rank: Option<u32>,
    ) -> Result<Option<EncodePlan>, InvalidParam> {
        let Some(push) = &self.push else {
            return self.plan(req);
        };
        match self.plan(req)? {
            Some(plan) => push.annotate(plan, consumer, rank).map(Some),
            None => Ok(None),
        }
    }

    fn fold(
        &self,
        plan: &EncodePlan,
        answers: &[Bytes],
    ) -> Result<Vec<(&'static str, Bytes)>, ConnectorError> {
        let merged = merge_answers(answers)?;
        if merged.is_empty() {
            return Ok(Vec::new());
        }
        let raw = match &self.push {
            // Mooncake: the consumer is told which transfers to wait for.
            Some(_) => match push::fold(plan, answers)? {
                Some(raw) => raw,
                None => return Ok(Vec::new()),
            },
            None => Bytes::from(serde_json::to_vec(&merged).map_err(|source| {
                ConnectorError::Encode {
                    field: "ec_transfer_params",
                    source,
                }
            })?),
        };
        let mut fields = vec![("ec_transfer_params", raw)];
        if self.placeholders
            && let Some((_, messages)) = plan.fields.iter().find(|(k, _)| *k == "messages")
            && let Some(rewritten) = placeholders(messages, &merged)
        {
            fields.push(("messages", rewritten));
        }
        Ok(fields)
    }
}

/// `messages` (whose media parts carry their uuids) with every image, audio and video
/// item rewritten to its embeddings placeholder (vLLM 0.33's `image_embeds`,
/// `audio_embeds` and `video_embeds` parts, `renderers/chat_utils/types.py`), modality
/// by modality where every item of the modality has an entry in `merged` (vLLM's
/// `_resolve_items`, `renderers/chat_utils/item_tracker.py`, refuses raw and embedded
/// items of one modality); `None` when nothing is rewritten.
fn placeholders(messages: &[u8], merged: &Entries) -> Option<Bytes> {
    let parts = chat::media_parts(messages, usize::MAX).ok().flatten()?;
    let entry = |p: &chat::MediaPart<'_>| p.uuid.as_ref().and_then(|u| merged.get(u));
    let covered = |m: &str| {
        parts
            .iter()
            .filter(|p| p.modality() == m)
            .all(|p| entry(p).is_some())
    };
    let (images, audio, video) = (covered("image"), covered("audio"), covered("video"));
    let mut edits = Vec::new();
    for part in &parts {
        let m = part.modality();
        let rewrite = match m {
            "image" => images,
            "audio" => audio,
            "video" => video,
            _ => false,
        };
        let (true, Some(entry), Some(uuid)) = (rewrite, entry(part), &part.uuid) else {
            continue;
        };
        // The entry's `metadata` as the engine wrote it (the last, when repeated), when
        // it is a non-empty object; `null` otherwise.
        let metadata = json::member(entry.get(), "metadata")
            .map(RawValue::get)
            .filter(|m| is_filled_object(m))
            .unwrap_or("null");
        let ty = format!("{m}_embeds");
        // The members in the order a built map wrote them (`*_embeds` < `type` < `uuid`).
        let mut bytes = Vec::with_capacity(metadata.len() + uuid.len() + 2 * ty.len() + 32);
        let mut placeholder = json::Object::open(&mut bytes);
        placeholder.raw(&ty, metadata.as_bytes());
        placeholder.value("type", &ty);
        placeholder.value("uuid", uuid);
        placeholder.close();
        edits.push((part.start, part.end, bytes));
    }
    if edits.is_empty() {
        return None;
    }
    Some(Bytes::from(chat::splice(messages, &edits)))
}

/// One media item on an encoder leg: its part's JSON, and the `uuid` to add to it.
#[derive(Clone, Copy)]
struct LegPart<'a> {
    raw: &'a [u8],
    uuid: Option<&'a str>,
}

/// The `,"uuid":"…"` that names an item, inserted before its part's closing brace.
fn uuid_field(uuid: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(uuid.len() + 10);
    out.extend_from_slice(br#","uuid":"#);
    disagg_json::write_json_str(&mut out, uuid.as_bytes());
    out
}

/// The encoder legs of `batches`, each batch's parts in one leg (see [`leg_body`]).
fn encode_legs(
    model: Option<&[u8]>,
    batches: &[Vec<LegPart<'_>>],
    copied: &[(&str, &[u8])],
) -> Vec<EncodeLeg> {
    batches
        .iter()
        .map(|parts| EncodeLeg {
            body: leg_body(model, parts, copied),
            items: parts.len(),
        })
        .collect()
}

/// One encoder leg's body: `{model, messages: [{role: "user", content: parts}], stream:
/// false, max_tokens: 1, copied...}`, written from raw JSON (`model` left out when absent
/// or `null`); a part with a `uuid` to add gets it last, so that it wins over any the
/// client wrote (the last of duplicate keys is the one engines read).
fn leg_body(model: Option<&[u8]>, parts: &[LegPart<'_>], copied: &[(&str, &[u8])]) -> Bytes {
    let len = parts.iter().map(|p| p.raw.len() + 48).sum::<usize>()
        + copied
            .iter()
            .map(|(k, v)| k.len() + v.len() + 4)
            .sum::<usize>()
        + model.map_or(0, <[u8]>::len)
        + 96;
    let mut out = Vec::with_capacity(len);
    out.push(b'{');
    if let Some(model) = model.filter(|m| *m != b"null") {
        out.extend_from_slice(b"\"model\":");
        out.extend_from_slice(model);
        out.push(b',');
    }
    out.extend_from_slice(br#""messages":[{"role":"user","content":["#);
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        match (part.uuid, part.raw.split_last()) {
            (Some(uuid), Some((b'}', head))) => {
                out.extend_from_slice(head);
                out.extend_from_slice(&uuid_field(uuid));
                out.push(b'}');
            }
            _ => out.extend_from_slice(part.raw),
        }
    }
    out.extend_from_slice(br#"]}],"stream":false,"max_tokens":1"#);
    for (key, value) in copied {
        out.extend_from_slice(b",\"");
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(b"\":");
        out.extend_from_slice(value);
    }
    out.push(b'}');
    Bytes::from(out)
}

/// Groups items into legs: a batched item joins the last leg while it holds batched
/// items only and fewer than `batch`; anything else opens a leg.
fn group<T>(items: impl IntoIterator<Item = (T, bool)>, batch: usize) -> Vec<Vec<T>> {
    let mut legs: Vec<(Vec<T>, bool)> = Vec::new();
    for (item, batched) in items {
        match legs.last_mut() {
            Some((leg, true)) if batched && leg.len() < batch => leg.push(item),
            _ => legs.push((vec![item], batched)),
        }
    }
    legs.into_iter().map(|(leg, _)| leg).collect()
}

impl VllmEncoder {
    /// Chat: the items of `messages`, each given its `uuid`, on legs and on the
    /// `messages` the prefill and decode legs carry. Built from raw slices of the
    /// client's body: the items' bytes are copied once into the legs and once into the
    /// new `messages` (the text between them with it), and never parsed into values.
    fn plan_chat(&self, req: &PdRequest) -> Result<Option<EncodePlan>, InvalidParam> {
        let body = req.body();
        let Some(messages) = body.get("messages") else {
            return Ok(None);
        };
        let Some(parts) = chat::media_parts(messages, MAX_ITEMS)? else {
            return Ok(None);
        };
        if parts.is_empty() {
            return Ok(None);
        }
        let mut kwargs = Vec::new();
        let mut copied = Vec::new();
        for key in COPIED {
            if let Some(v) = body.get(key).filter(|v| *v != b"null") {
                kwargs.extend_from_slice(v);
                copied.push((*key, v));
            }
        }
        // Each item's uuid: the client's, or one derived from its content.
        let mut uuids = Vec::with_capacity(parts.len());
        for part in &parts {
            uuids.push(match &part.uuid {
                Some(_) => None,
                None => Some(item_uuid(part, &kwargs)?),
            });
        }
        let legs = group(
            parts.iter().zip(&uuids).map(|(part, uuid)| {
                let leg = LegPart {
                    raw: part.raw.as_bytes(),
                    uuid: uuid.as_deref(),
                };
                (leg, part.batched())
            }),
            self.image_batch,
        );
        let model = body.get("model");
        let legs = encode_legs(model, &legs, &copied);
        // The prefill and decode legs' `messages`: the client's, each uuid inserted
        // before its part's closing brace.
        let edits: Vec<(usize, usize, Vec<u8>)> = parts
            .iter()
            .zip(&uuids)
            .filter_map(|(part, uuid)| {
                let at = part.end.checked_sub(1)?;
                Some((at, at, uuid_field(uuid.as_deref()?)))
            })
            .collect();
        let messages = if edits.is_empty() {
            body.get_bytes("messages").unwrap_or_default()
        } else {
            Bytes::from(chat::splice(messages, &edits))
        };
        Ok(Some(EncodePlan {
            legs,
            fields: vec![("messages", messages)],
            rank: None,
        }))
    }
}

/// The answers' `ec_transfer_params` entries, keyed by item identifier, each value
/// as its engine wrote it (never built: see [`answer_entries`]).
type Entries = BTreeMap<String, Box<RawValue>>;

/// The answers' `ec_transfer_params`, merged (their keys are item identifiers).
fn merge_answers(answers: &[Bytes]) -> Result<Entries, ConnectorError> {
    let mut merged = Entries::new();
    for answer in answers {
        answer_entries(answer, |hash, entry| {
            if merged.len() >= MAX_ENTRIES {
                return Err(too_many());
            }
            merged.insert(hash, entry.to_owned());
            Ok(())
        })?;
    }
    Ok(merged)
}

/// Refuses an answer whose `ec_transfer_params` holds more than [`MAX_ENTRIES`].
fn too_many() -> ConnectorError {
    ConnectorError::InvalidEncoderAnswer {
        problem: "`ec_transfer_params` has too many entries",
        source: None,
    }
}

/// Calls `f` with each entry of `answer`'s `ec_transfer_params` (none when it is absent
/// or `null`: an encoder that wrote nothing for its items, no EC connector or items its
/// model cannot hand over, leaves them to the prefill), sorted by identifier, the last
/// of a repeated identifier only (as a parsed map holds them), each value unbuilt: a
/// slice of the engine's bytes. The object's members are counted and measured as they
/// are walked, before anything is kept: an object of more than [`MAX_ENTRIES`] members,
/// or with one longer than [`MAX_ENTRY_BYTES`], is refused (as a `serde_json::Value`, a
/// 4 MiB answer of `{"a":[0,0,...]}` would have cost 60 MiB and one of small objects
/// hundreds). Stops at the first error of `f`.
///
/// # Errors
///
/// [`ConnectorError::InvalidEncoderAnswer`] when `answer` is not a JSON object, its
/// `ec_transfer_params` not an object or too large as said; `f`'s error.
fn answer_entries(
    answer: &Bytes,
    mut f: impl FnMut(String, &RawValue) -> Result<(), ConnectorError>,
) -> Result<(), ConnectorError> {
    let params = disagg_json::top_level_field(answer, "ec_transfer_params").map_err(|source| {
        ConnectorError::InvalidEncoderAnswer {
            problem: "not a JSON object",
            source: Some(source),
        }
    })?;
    let Some(params) = params else {
        return Ok(());
    };
    if &params[..] == b"null" {
        return Ok(());
    }
    let not_an_object = || ConnectorError::InvalidEncoderAnswer {
        problem: "`ec_transfer_params` is not an object",
        source: None::<BodyError>,
    };
    let text = std::str::from_utf8(&params).map_err(|_| not_an_object())?;
    if !json::is_object(text) {
        return Err(not_an_object());
    }
    let (mut count, mut too_large) = (0usize, false);
    // At most `MAX_ENTRIES` borrowed entries: 4096 keys and slices.
    let mut entries: BTreeMap<String, &RawValue> = BTreeMap::new();
    json::members(text, |key, value| {
        count = count.saturating_add(1);
        if count > MAX_ENTRIES || too_large {
            return;
        }
        if value.get().len() > MAX_ENTRY_BYTES {
            too_large = true;
            return;
        }
        entries.insert(key, value);
    })
    .map_err(|_| not_an_object())?;
    if count > MAX_ENTRIES {
        return Err(too_many());
    }
    if too_large {
        return Err(ConnectorError::InvalidEncoderAnswer {
            problem: "an `ec_transfer_params` entry is too large",
            source: None,
        });
    }
    for (hash, entry) in entries {
        f(hash, entry)?;
    }
    Ok(())
}

/// Whether the JSON text `raw` is an object with at least one member.
fn is_filled_object(raw: &str) -> bool {
    json::trim(raw)
        .strip_prefix('{')
        .is_some_and(|rest| !json::trim(rest).starts_with('}'))
}

/// Calls `f` with each element of the JSON list `raw`, in order and unbuilt (a
/// `Vec<&RawValue>` is 16 bytes per element, eight times a client's `[0,0,...]`),
/// until `f` fails; the elements after are walked over (still unbuilt) without `f`.
///
/// Returns `Ok(false)` when `raw` is not one JSON list (whatever `f` said of the
/// elements before the fault: the list is then no list, as when parsed whole).
///
/// # Errors
///
/// The first error of `f`.
fn each_element<'a, E>(
    raw: &'a str,
    mut f: impl FnMut(&'a RawValue) -> Result<(), E>,
) -> Result<bool, E> {
    if !json::is_list(raw) {
        return Ok(false);
    }
    let mut failed = None;
    let walked = json::elements(raw, |value| {
        if failed.is_none()
            && let Err(e) = f(value)
        {
            failed = Some(e);
        }
    });
    match (walked, failed) {
        (Err(_), _) => Ok(false),
        (Ok(()), Some(e)) => Err(e),
        (Ok(()), None) => Ok(true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use disagg_core::request::Api;
    use serde_json::{Map, Value, json};

    fn request(body: Value) -> PdRequest {
        PdRequest::new(
            Api::Chat,
            Default::default(),
            &Bytes::from(body.to_string()),
        )
        .unwrap()
    }

    fn image(url: &str) -> Value {
        json!({"type": "image_url", "image_url": {"url": url}})
    }

    #[test]
    fn images_share_legs_up_to_the_batch_and_audio_goes_alone() {
        let req = request(json!({
            "model": "m",
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "look"},
                image("data:a"), image("data:b"), image("data:c"),
                {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}},
            ]}],
            "mm_processor_kwargs": {"fps": 2},
        }));
        let plan = VllmEncoder::new()
            .with_image_batch(2)
            .plan(&req)
            .unwrap()
            .unwrap();
        let sizes: Vec<usize> = plan.legs.iter().map(|l| l.items).collect();
        assert_eq!(sizes, [2, 1, 1]);
        let leg: Value = serde_json::from_slice(&plan.legs[0].body).unwrap();
        assert_eq!(leg["stream"], false);
        assert_eq!(leg["max_tokens"], 1);
        assert_eq!(leg["mm_processor_kwargs"], json!({"fps": 2}));
        assert_eq!(leg["messages"][0]["content"].as_array().unwrap().len(), 2);
        // The uuid on the leg is the one the prefill's messages carry.
        let messages: Value = serde_json::from_slice(&plan.fields[0].1).unwrap();
        let uuid = &messages[0]["content"][1]["uuid"];
        assert!(uuid.is_string());
        assert_eq!(&leg["messages"][0]["content"][0]["uuid"], uuid);
        // Text parts stay, without a uuid.
        assert!(messages[0]["content"][0].get("uuid").is_none());
    }

    #[test]
    fn the_uuid_follows_the_content_and_the_kwargs() {
        let uuid = |body: Value| {
            let plan = VllmEncoder::new().plan(&request(body)).unwrap().unwrap();
            let m: Value = serde_json::from_slice(&plan.fields[0].1).unwrap();
            m[0]["content"][0]["uuid"].clone()
        };
        let msgs = |url: &str| json!([{"role": "user", "content": [image(url)]}]);
        let a = uuid(json!({"messages": msgs("data:a")}));
        assert_eq!(a, uuid(json!({"messages": msgs("data:a")})));
        assert_ne!(a, uuid(json!({"messages": msgs("data:b")})));
        assert_ne!(
            a,
            uuid(json!({"messages": msgs("data:a"), "media_io_kwargs": {"x": 1}}))
        );
        let mut given = msgs("data:a");
        given[0]["content"][0]["uuid"] = json!("mine");
        assert_eq!(uuid(json!({"messages": given})), json!("mine"));
    }

    #[test]
    fn responses_and_messages_legs_are_chat_with_their_routes_kwargs_only() {
        let input = json!([{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:a"},
            {"type": "input_image", "image_url": "data:b"},
            {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}},
        ]}]);
        let body = json!({"model": "m", "input": input, "media_io_kwargs": {"v": 1},
                          "mm_processor_kwargs": {"fps": 2}});
        let req = PdRequest::new(
            Api::Responses,
            Default::default(),
            &Bytes::from(body.to_string()),
        )
        .unwrap();
        let plan = VllmEncoder::new().plan(&req).unwrap().unwrap();
        // The client's input goes on unchanged: the prefill hashes it as the encoders do.
        assert!(plan.fields.is_empty());
        assert_eq!(
            plan.legs.iter().map(|l| l.items).collect::<Vec<_>>(),
            [2, 1]
        );
        let leg: Value = serde_json::from_slice(&plan.legs[0].body).unwrap();
        assert_eq!(
            leg,
            json!({"model": "m", "stream": false, "max_tokens": 1,
                   "mm_processor_kwargs": {"fps": 2},
                   "messages": [{"role": "user", "content": [
                       {"type": "image_url", "image_url": {"url": "data:a"}},
                       {"type": "image_url", "image_url": {"url": "data:b"}}]}]})
        );
        let body = json!({"model": "m", "max_tokens": 4, "mm_processor_kwargs": {"fps": 2},
            "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://x"}}]}]});
        let req = PdRequest::new(
            Api::Messages,
            Default::default(),
            &Bytes::from(body.to_string()),
        )
        .unwrap();
        let plan = VllmEncoder::new().plan(&req).unwrap().unwrap();
        let leg: Value = serde_json::from_slice(&plan.legs[0].body).unwrap();
        assert!(leg.get("mm_processor_kwargs").is_none(), "{leg}");
        assert_eq!(
            leg["messages"][0]["content"][0],
            json!({"type": "image_url", "image_url": {"url": "https://x"}})
        );
    }

    /// An encoder's answer naming `uuids` (with `metadata`).
    fn answer(uuids: &[&Value], metadata: Value) -> Bytes {
        let entries: Map<String, Value> = uuids
            .iter()
            .map(|u| {
                let entry = json!({"modality": "image", "item_indices": [0], "metadata": metadata});
                (u.as_str().unwrap().to_owned(), entry)
            })
            .collect();
        Bytes::from(json!({"ec_transfer_params": entries}).to_string())
    }

    #[test]
    fn placeholders_replace_the_items_a_whole_modality_of_which_was_handed_over() {
        let req = request(json!({
            "model": "m",
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "look"},
                image("data:a"), image("data:b"),
                {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}},
                {"type": "video_url", "video_url": {"url": "v"}},
            ]}],
        }));
        let encoder = VllmEncoder::new().with_embeds_placeholders(true);
        let plan = encoder.plan(&req).unwrap().unwrap();
        let messages: Value = serde_json::from_slice(&plan.fields[0].1).unwrap();
        let uuid = |i: usize| messages[0]["content"][i]["uuid"].clone();
        let (a, b, audio, video) = (uuid(1), uuid(2), uuid(3), uuid(4));
        // Both images and the video handed over, the audio not: the images and the
        // video become placeholders (metadata kept), the audio keeps its media.
        let answers = [
            answer(&[&a, &b], json!({"image_grid_thw": [1, 4, 4]})),
            answer(&[&video], json!({})),
        ];
        let fields = encoder.fold(&plan, &answers).unwrap();
        assert_eq!(fields.len(), 2);
        assert_eq!(fields[1].0, "messages");
        let rewritten: Value = serde_json::from_slice(&fields[1].1).unwrap();
        let content = &rewritten[0]["content"];
        assert_eq!(content[0], messages[0]["content"][0]);
        assert_eq!(
            content[1],
            json!({"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": a})
        );
        assert_eq!(content[2]["type"], "image_embeds");
        assert_eq!(content[2]["uuid"], b);
        assert_eq!(content[3], messages[0]["content"][3]);
        assert_eq!(
            content[4],
            json!({"type": "video_embeds", "video_embeds": null, "uuid": video})
        );
        // The audio handed over too: it becomes one, with `null` for empty metadata.
        let answers = [answer(&[&a, &b, &audio], json!({}))];
        let fields = encoder.fold(&plan, &answers).unwrap();
        let rewritten: Value = serde_json::from_slice(&fields[1].1).unwrap();
        assert_eq!(
            rewritten[0]["content"][3],
            json!({"type": "audio_embeds", "audio_embeds": null, "uuid": audio})
        );
        // One image missing: vLLM refuses raw and embedded images in one request, so
        // both keep their media; nothing to rewrite at all.
        let fields = encoder.fold(&plan, &[answer(&[&a], json!({}))]).unwrap();
        assert_eq!(fields.len(), 1, "{fields:?}");
        // Off (the default): never rewritten.
        let fields = VllmEncoder::new().fold(&plan, &answers).unwrap();
        assert_eq!(fields.len(), 1);
    }

    #[test]
    fn videos_become_placeholders_only_when_every_one_was_handed_over() {
        let video = |u: &str| json!({"type": "video_url", "video_url": {"url": u}});
        let req = request(json!({
            "model": "m",
            "messages": [{"role": "user", "content": [video("v1"), image("data:a"), video("v2")]}],
        }));
        let encoder = VllmEncoder::new().with_embeds_placeholders(true);
        let plan = encoder.plan(&req).unwrap().unwrap();
        let messages: Value = serde_json::from_slice(&plan.fields[0].1).unwrap();
        let uuid = |i: usize| messages[0]["content"][i]["uuid"].clone();
        let (v1, a, v2) = (uuid(0), uuid(1), uuid(2));
        // One video missing: both keep their media; the image is rewritten alone.
        let fields = encoder
            .fold(&plan, &[answer(&[&v1, &a], json!({}))])
            .unwrap();
        let rewritten: Value = serde_json::from_slice(&fields[1].1).unwrap();
        assert_eq!(rewritten[0]["content"][0], messages[0]["content"][0]);
        assert_eq!(rewritten[0]["content"][1]["type"], "image_embeds");
        assert_eq!(rewritten[0]["content"][2], messages[0]["content"][2]);
        // Both handed over: both are `video_embeds` parts, metadata as the encoder gave.
        let answers = [
            answer(&[&v1, &v2], json!({"video_grid_thw": [2, 4, 4]})),
            answer(&[&a], json!({})),
        ];
        let fields = encoder.fold(&plan, &answers).unwrap();
        let rewritten: Value = serde_json::from_slice(&fields[1].1).unwrap();
        for (i, u) in [(0, &v1), (2, &v2)] {
            assert_eq!(
                rewritten[0]["content"][i],
                json!({"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4]},
                       "uuid": u})
            );
        }
    }

    /// The uuid the plan gives the first media item of `messages` (raw JSON), with the
    /// request's `extra` fields.
    fn first_uuid(messages: &str, extra: &str) -> String {
        let body = format!(r#"{{"model":"m","messages":{messages}{extra}}}"#);
        let req = PdRequest::new(Api::Chat, Default::default(), &Bytes::from(body)).unwrap();
        let plan = VllmEncoder::new().plan(&req).unwrap().unwrap();
        let m: Value = serde_json::from_slice(&plan.fields[0].1).unwrap();
        m.as_array()
            .unwrap()
            .iter()
            .flat_map(|t| t["content"].as_array().cloned().unwrap_or_default())
            .find_map(|p| p["uuid"].as_str().map(str::to_owned))
            .unwrap()
    }

    #[test]
    fn known_items_keep_their_uuid() {
        // Pinned: a change of the hashing would make a proxy upgrade name every cached
        // item anew (and two proxy versions disagree on one engine pool).
        let plain = r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]"#;
        let spaced = r#"[ {"role":"user","content":[ "x", {"type":"text","text":"hi"},
            { "image_url" : { "detail":"auto", "url" : "data:image\/png;base64,AAAA\u00e9" }, "type":"image_url", "uuid": null, "n": 1.50, "e": [1e2, -0, true, {"b":2,"a":"\u0001"}] } ]}]"#;
        let audio = r#"[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"QUJD","format":"wav"}}]}]"#;
        let kwargs = r#","mm_processor_kwargs":{"fps":2,"a":[1,2]},"media_io_kwargs":{"video":{"num_frames":4}}"#;
        assert_eq!(first_uuid(plain, ""), "f82aa6e5f82cf5e9482b8ecd1ffaaac5");
        assert_eq!(
            first_uuid(plain, kwargs),
            "6266012fb75ddd07af302fbf6dccbead"
        );
        assert_eq!(first_uuid(spaced, ""), "254a984532333d98b292c6f990747da7");
        assert_eq!(
            first_uuid(audio, kwargs),
            "8279f9ec32948236751d04cdf3aa0afc"
        );
    }

    #[test]
    fn text_only_messages_plan_nothing() {
        let req = request(json!({"messages": [{"role": "user", "content": "see image_url\""}]}));
        assert!(VllmEncoder::new().plan(&req).unwrap().is_none());
    }

    #[test]
    fn answers_are_merged_and_bad_ones_refused() {
        let a = Bytes::from_static(
            br#"{"id":"x","ec_transfer_params":{"h1":{"modality":"image","item_indices":[0],"metadata":{}}}}"#,
        );
        let b = Bytes::from_static(
            br#"{"ec_transfer_params":{"h2":{"modality":"image","item_indices":[0],"metadata":{}}}}"#,
        );
        let fields = VllmEncoder::new()
            .fold(&EncodePlan::default(), &[a, b])
            .unwrap();
        let merged: Value = serde_json::from_slice(&fields[0].1).unwrap();
        assert_eq!(fields[0].0, "ec_transfer_params");
        assert!(merged["h1"].is_object() && merged["h2"].is_object());
        let bad = Bytes::from_static(br#"{"ec_transfer_params":[1]}"#);
        assert!(
            VllmEncoder::new()
                .fold(&EncodePlan::default(), &[bad])
                .is_err()
        );
        assert!(
            VllmEncoder::new()
                .fold(&EncodePlan::default(), &[Bytes::from_static(b"[]")])
                .is_err()
        );
        let none = Bytes::from_static(br#"{"ec_transfer_params":null}"#);
        assert!(
            VllmEncoder::new()
                .fold(&EncodePlan::default(), &[none])
                .unwrap()
                .is_empty()
        );
    }

    /// The problem `fold` refuses `answers` with.
    fn refusal(answers: &[Bytes]) -> &'static str {
        match VllmEncoder::new().fold(&EncodePlan::default(), answers) {
            Err(ConnectorError::InvalidEncoderAnswer { problem, .. }) => problem,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn entries_keep_the_engines_spelling_and_the_last_of_a_repeated_identifier() {
        // `1e400` is no `serde_json::Value`: an entry built as one refused the answer.
        let a = Bytes::from_static(
            br#"{"ec_transfer_params":{"h1":{"metadata":{"x":1}}, "h0":{"metadata" : {"x":1e400}},
                "h1":{"metadata":{"x":2}}}}"#,
        );
        let b = Bytes::from_static(br#"{"ec_transfer_params":{"h2":[ 1.50 ]}}"#);
        let fields = VllmEncoder::new()
            .fold(&EncodePlan::default(), &[a, b])
            .unwrap();
        assert_eq!(
            std::str::from_utf8(&fields[0].1).unwrap(),
            r#"{"h0":{"metadata" : {"x":1e400}},"h1":{"metadata":{"x":2}},"h2":[ 1.50 ]}"#
        );
    }

    #[test]
    fn too_many_or_too_large_entries_are_refused_as_they_are_walked() {
        let answer =
            |entries: &str| Bytes::from(format!(r#"{{"ec_transfer_params":{{{entries}}}}}"#));
        let many = |from: usize, n: usize| {
            (from..from + n)
                .map(|i| format!(r#""h{i}":0"#))
                .collect::<Vec<_>>()
                .join(",")
        };
        // The ceiling, in one answer or over several.
        assert!(
            VllmEncoder::new()
                .fold(&EncodePlan::default(), &[answer(&many(0, MAX_ENTRIES))])
                .is_ok()
        );
        let too_many = "`ec_transfer_params` has too many entries";
        assert_eq!(refusal(&[answer(&many(0, MAX_ENTRIES + 1))]), too_many);
        assert_eq!(
            refusal(&[answer(&many(0, MAX_ENTRIES)), answer(&many(MAX_ENTRIES, 1))]),
            too_many
        );
        // An entry longer than the ceiling, by its raw length (its `[0,0,...]` would
        // have been 16 bytes a byte as a `Value`).
        let zeros = vec!["0"; MAX_ENTRY_BYTES / 2 + 1].join(",");
        assert_eq!(
            refusal(&[answer(&format!(r#""h":[{zeros}]"#))]),
            "an `ec_transfer_params` entry is too large"
        );
        let fits = vec!["0"; MAX_ENTRY_BYTES / 2 - 1].join(",");
        assert!(
            VllmEncoder::new()
                .fold(
                    &EncodePlan::default(),
                    &[answer(&format!(r#""h":[{fits}]"#))]
                )
                .is_ok()
        );
        // A malformed object is still not an object.
        assert_eq!(
            refusal(&[Bytes::from_static(br#"{"ec_transfer_params":"x"}"#)]),
            "`ec_transfer_params` is not an object"
        );
    }

    #[test]
    fn a_placeholder_carries_its_entrys_metadata_as_the_engine_wrote_it() {
        let messages = br#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a"},"uuid":"u"},{"type":"image_url","image_url":{"url":"b"},"uuid":"v"}]}]"#;
        let merged = merge_answers(&[Bytes::from_static(
            br#"{"ec_transfer_params":{"u":{"metadata":{"g": [1e400]}},"v":{"metadata":{ },"metadata":{"g":1}}}}"#,
        )])
        .unwrap();
        let out = placeholders(messages, &merged).unwrap();
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"[{"role":"user","content":[{"image_embeds":{"g": [1e400]},"type":"image_embeds","uuid":"u"},{"image_embeds":{"g":1},"type":"image_embeds","uuid":"v"}]}]"#
        );
        // Empty metadata, or none that is an object, is `null`.
        for metadata in [r#"{ }"#, "[1]", "7"] {
            let answer =
                format!(r#"{{"ec_transfer_params":{{"u":{{"metadata":{metadata}}},"v":0}}}}"#);
            let merged = merge_answers(&[Bytes::from(answer)]).unwrap();
            let out = placeholders(messages, &merged).unwrap();
            let v: Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(
                v[0]["content"][0]["image_embeds"],
                Value::Null,
                "{metadata}"
            );
            assert_eq!(
                v[0]["content"][1]["image_embeds"],
                Value::Null,
                "{metadata}"
            );
        }
    }

    #[test]
    fn lists_are_walked_until_the_visitor_fails() {
        let mut seen = Vec::new();
        let got = each_element(" [1, [2], {\"a\":3}, 4] ", |v| {
            seen.push(v.get().to_owned());
            if seen.len() == 3 { Err("stop") } else { Ok(()) }
        });
        assert_eq!(got, Err("stop"));
        assert_eq!(seen, ["1", "[2]", r#"{"a":3}"#]);
        assert_eq!(each_element::<()>("[]", |_| panic!("empty")), Ok(true));
        for not in [r#""[1]""#, "{}", "[1,", "[1] 2"] {
            assert_eq!(each_element::<()>(not, |_| Ok(())), Ok(false), "{not}");
        }
        assert!(is_filled_object(r#" { "a" : 1 } "#));
        assert!(!is_filled_object(" { \n } ") && !is_filled_object("[1]"));
    }

    #[test]
    fn a_media_part_nested_past_the_ceiling_is_refused_not_overflowed() {
        let deep = format!("{}{}", "[".repeat(1_000_000), "]".repeat(1_000_000));
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"a"}},"e":{deep}}}]}}]}}"#
        );
        let req = PdRequest::new(Api::Chat, Default::default(), &Bytes::from(body)).unwrap();
        let err = VllmEncoder::new().plan(&req).unwrap_err();
        assert!(err.to_string().contains("too deeply"), "{err}");
    }
}
