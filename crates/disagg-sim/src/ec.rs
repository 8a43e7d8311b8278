//! Encoder disaggregation (E/P/D), as vLLM 0.33 runs it with its shared-storage EC
//! connector (`vllm/distributed/ec_transfer/ec_connector/example_connector.py`): an
//! encoder-only engine (`ec_role: ec_producer`) encodes a chat request's media items,
//! writes each item's "embeddings" under its identifier in a directory it shares with the
//! prefill, and answers with `ec_transfer_params` keyed by identifier
//! (`ec_connector/utils.py`, `collect_ec_item_metadata`); a consumer (`ec_consumer`)
//! reads every media item of its requests from that directory.
//!
//! An item's identifier is its `uuid` when the request names one, else a hash of its
//! content. A consumer that finds an item missing (its encoder was skipped, or was told
//! another identifier) fails the request with 500: the simulated prefill has no encoder
//! of its own, so a wrong orchestration really fails.

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
fn embeddings(id: &str) -> Vec<u8> {
    format!("sim-embeddings:{id}").into_bytes()
}

/// The modality of a content part's type, for the media types vLLM's chat API takes.
fn modality(ty: &str) -> Option<&'static str> {
    match ty {
        "image_url" | "image_embeds" => Some("image"),
        "input_audio" | "audio_url" | "audio_embeds" => Some("audio"),
        "video_url" => Some("video"),
        _ => None,
    }
}

/// FNV-1a over the part's content (its `uuid` left out), as 16 hex digits.
fn content_hash(part: &Map<String, Value>) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for (k, v) in part {
        if k == "uuid" {
            continue;
        }
        eat(k.as_bytes());
        eat(&serde_json::to_vec(v).unwrap_or_default());
    }
    format!("{h:016x}")
}

/// Each media item of a chat body's `messages`, in order: its identifier and modality.
pub(crate) fn items(body: &Value) -> Result<Vec<(String, &'static str)>, ApiError> {
    let mut out = Vec::new();
    let Some(Value::Array(messages)) = body.get("messages") else {
        return Ok(out);
    };
    for message in messages {
        let Some(Value::Array(parts)) = message.get("content") else {
            continue;
        };
        for part in parts {
            let Some(obj) = part.as_object() else {
                continue;
            };
            let Some(m) = obj.get("type").and_then(Value::as_str).and_then(modality) else {
                continue;
            };
            if out.len() >= MAX_ITEMS {
                return Err(ApiError::bad_request("too many multimodal items"));
            }
            let id = match obj.get("uuid") {
                Some(Value::String(u)) if !u.is_empty() => {
                    let safe = u.len() <= MAX_ID
                        && u.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
                    if !safe {
                        return Err(ApiError::bad_request(
                            "uuid: letters, digits, '-' and '_' only, at most 128",
                        ));
                    }
                    u.clone()
                }
                _ => content_hash(obj),
            };
            out.push((id, m));
        }
    }
    Ok(out)
}

fn item_path(store: &Path, id: &str) -> PathBuf {
    store.join(id).join("encoder_cache.bin")
}

/// An encoder leg: every item encoded into the store; the answer's
/// `ec_transfer_params` (keyed by identifier, each `{modality, item_indices, metadata}`).
pub(crate) fn encode(store: &Path, body: &Value) -> Result<(Value, usize), ApiError> {
    let items = items(body)?;
    let mut params = Map::new();
    for (index, (id, m)) in items.iter().enumerate() {
        let path = item_path(store, id);
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&path, embeddings(id)));
        if let Err(e) = written {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot save the encoder cache of {id}: {e}"),
            ));
        }
        let entry = params
            .entry(id.clone())
            .or_insert_with(|| json!({"modality": m, "item_indices": [], "metadata": {}}));
        if let Some(Value::Array(indices)) = entry.get_mut("item_indices") {
            indices.push(Value::from(index));
        }
    }
    Ok((Value::Object(params), items.len()))
}

/// A consumer's request: every media item read from the store. How many were read.
pub(crate) fn load(store: &Path, body: &Value) -> Result<usize, ApiError> {
    let items = items(body)?;
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
        assert_eq!(load(&store, &body).unwrap(), 3);
        let other = json!({"messages": [{"role": "user", "content": [img("c")]}]});
        assert_eq!(
            load(&store, &other).unwrap_err().status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
        let escape = json!({"messages": [{"role": "user", "content": [img("../x")]}]});
        assert_eq!(
            encode(&store, &escape).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        std::fs::remove_dir_all(store).unwrap();
    }
}
