//! The media items of a Responses or Messages request, written as the chat parts vLLM
//! 0.33 turns them into before its multimodal processor sees them.
//!
//! Neither API hands a per-item `uuid` to the processor, so the consumer names each item
//! by hashing its content (the decoded media and the request's processor kwargs). The
//! encoder leg must therefore carry the very media the consumer will load, with no
//! `uuid` of its own:
//!
//! - `/v1/responses` (`vllm/entrypoints/openai/responses/protocol.py`): `input` is
//!   validated against the `openai` package's `ResponseInputItemParam` typed dicts, which
//!   keep no key they do not declare, so a `uuid` on a part never gets through; the
//!   user, system and developer messages then go to the chat parser as they are
//!   (`responses/utils.py`, `_construct_message_from_response_item`), where an
//!   `input_image` part is read as an image from its `image_url` string and an
//!   `input_audio` part as chat's own (`vllm/renderers/chat_utils/`,
//!   `MM_PARSER_MAP`). Assistant items become text.
//! - `/v1/messages` (`vllm/entrypoints/anthropic/serving.py`): the content block model
//!   (`anthropic/protocol.py`, `AnthropicContentBlock`) has no `uuid` either; an `image`
//!   block becomes `{"type": "image_url", "image_url": {"url": U}}` where `U` is the
//!   source's `url` for a `url` source, and `data:<media_type>;base64,<data>` otherwise
//!   (`media_type` defaulting to `image/jpeg`), `_convert_image_source_to_url`; the
//!   images of a user's `tool_result` block go the same way. System messages are text.
//!
//! Values are read as raw slices of the client's body (nothing is built for the text
//! around the items), and the parts written reuse the client's string bytes as they are
//! escaped: the JSON string they make decodes to the URL vLLM builds.

use serde::Deserialize;
use serde_json::value::RawValue;

use disagg_json::InvalidParam;

/// One media item for an encoder leg: its chat part, and whether it may share a leg with
/// others (images may; audio goes alone).
#[derive(Debug)]
pub(super) struct Item {
    /// The chat content part, JSON.
    pub(super) part: Vec<u8>,
    /// Whether the item may share a leg.
    pub(super) batched: bool,
}

/// A message or input item: the fields read from it.
#[derive(Deserialize)]
struct Turn<'a> {
    #[serde(borrow, rename = "type", default)]
    ty: Option<&'a RawValue>,
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// A content part or block: the fields read from it.
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, rename = "type", default)]
    ty: Option<&'a RawValue>,
    #[serde(borrow, default)]
    image_url: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input_audio: Option<&'a RawValue>,
    #[serde(borrow, default)]
    source: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// An Anthropic image source.
#[derive(Deserialize)]
struct Source<'a> {
    #[serde(borrow, rename = "type", default)]
    ty: Option<&'a RawValue>,
    #[serde(borrow, default)]
    url: Option<&'a RawValue>,
    #[serde(borrow, default)]
    media_type: Option<&'a RawValue>,
    #[serde(borrow, default)]
    data: Option<&'a RawValue>,
}

/// Whether `raw` is the JSON string `name` (written without escapes, as every client
/// writes part types).
fn is(raw: Option<&RawValue>, name: &str) -> bool {
    raw.is_some_and(|r| {
        let t = r.get().as_bytes();
        t.len() == name.len() + 2 && t.get(1..t.len() - 1) == Some(name.as_bytes())
    })
}

/// The escaped text between a JSON string's quotes, or `None` when `raw` is not a string.
fn string_body(raw: &RawValue) -> Option<&str> {
    let t = raw.get();
    t.strip_prefix('"')?.strip_suffix('"')
}

/// Calls `f` with each element of the JSON list `raw`, walked in order and unbuilt (a
/// `Vec<&RawValue>` of them was eight times a client's `[0,0,...]`), until `f` fails;
/// nothing when `raw` is not a list.
///
/// # Errors
///
/// The first error of `f`.
fn each<'a>(
    raw: &'a str,
    f: impl FnMut(&'a RawValue) -> Result<(), InvalidParam>,
) -> Result<(), InvalidParam> {
    super::each_element(raw, f).map(|_| ())
}

/// Collects items up to `max`.
struct Items {
    out: Vec<Item>,
    max: usize,
    param: &'static str,
}

impl Items {
    fn push(&mut self, part: Vec<u8>, batched: bool) -> Result<(), InvalidParam> {
        if self.out.len() >= self.max {
            return Err(InvalidParam::new(
                self.param,
                "holds more media items than the encoder stage takes",
            ));
        }
        self.out.push(Item { part, batched });
        Ok(())
    }
}

/// The chat part of an image at `url_body` (a JSON string's escaped text).
fn image_part(url_body: &[&str]) -> Vec<u8> {
    let len: usize = url_body.iter().map(|s| s.len()).sum();
    let mut out = Vec::with_capacity(len + 48);
    out.extend_from_slice(br#"{"type":"image_url","image_url":{"url":""#);
    for s in url_body {
        out.extend_from_slice(s.as_bytes());
    }
    out.extend_from_slice(br#""}}"#);
    out
}

/// The media items of a Responses request's `input` (a string input has none), at most
/// `max`.
///
/// # Errors
///
/// [`InvalidParam`] (`input`) when there are more than `max`.
pub(super) fn responses(input: &[u8], max: usize) -> Result<Vec<Item>, InvalidParam> {
    let mut items = Items {
        out: Vec::new(),
        max,
        param: "input",
    };
    let Ok(input) = std::str::from_utf8(input) else {
        return Ok(items.out);
    };
    each(input, |turn| {
        let Ok(turn) = serde_json::from_str::<Turn<'_>>(turn.get()) else {
            return Ok(());
        };
        if turn.ty.is_some_and(|_| !is(turn.ty, "message")) || is(turn.role, "assistant") {
            return Ok(());
        }
        let Some(content) = turn.content else {
            return Ok(());
        };
        each(content.get(), |part| {
            let Ok(part) = serde_json::from_str::<Part<'_>>(part.get()) else {
                return Ok(());
            };
            if is(part.ty, "input_image") {
                if let Some(url) = part.image_url.and_then(string_body) {
                    items.push(image_part(&[url]), true)?;
                }
            } else if is(part.ty, "input_audio")
                && let Some(audio) = part.input_audio
            {
                let mut out = Vec::with_capacity(audio.get().len() + 40);
                out.extend_from_slice(br#"{"type":"input_audio","input_audio":"#);
                out.extend_from_slice(audio.get().as_bytes());
                out.push(b'}');
                items.push(out, false)?;
            }
            Ok(())
        })
    })?;
    Ok(items.out)
}

/// The media items of a Messages request's `messages`, at most `max`.
///
/// # Errors
///
/// [`InvalidParam`] (`messages`) when there are more than `max`, or an image source's
/// `media_type` or `data` is not a string.
pub(super) fn messages(messages: &[u8], max: usize) -> Result<Vec<Item>, InvalidParam> {
    let mut items = Items {
        out: Vec::new(),
        max,
        param: "messages",
    };
    let Ok(messages) = std::str::from_utf8(messages) else {
        return Ok(items.out);
    };
    each(messages, |turn| {
        let Ok(turn) = serde_json::from_str::<Turn<'_>>(turn.get()) else {
            return Ok(());
        };
        if is(turn.role, "system") {
            return Ok(());
        }
        let user = is(turn.role, "user");
        let Some(content) = turn.content else {
            return Ok(());
        };
        each(content.get(), |block| {
            let Ok(block) = serde_json::from_str::<Part<'_>>(block.get()) else {
                return Ok(());
            };
            if is(block.ty, "image") {
                anthropic_image(block.source, &mut items)?;
            } else if is(block.ty, "tool_result")
                && user
                && let Some(inner) = block.content
            {
                each(inner.get(), |part| {
                    let Ok(part) = serde_json::from_str::<Part<'_>>(part.get()) else {
                        return Ok(());
                    };
                    if is(part.ty, "image") {
                        anthropic_image(part.source, &mut items)?;
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
    })?;
    Ok(items.out)
}

/// An Anthropic image block's item, as vLLM's `_convert_image_source_to_url` makes its
/// URL. A block without a source, or a URL source without a string `url`, is left to the
/// engine (it is no item the encoders could take).
fn anthropic_image(source: Option<&RawValue>, items: &mut Items) -> Result<(), InvalidParam> {
    let Some(source) = source.and_then(|s| serde_json::from_str::<Source<'_>>(s.get()).ok()) else {
        return Ok(());
    };
    if is(source.ty, "url") {
        if let Some(url) = source.url.and_then(string_body) {
            items.push(image_part(&[url]), true)?;
        }
        return Ok(());
    }
    let media_type = source_text(source.media_type, "image/jpeg", "media_type")?;
    let data = source_text(source.data, "", "data")?;
    items.push(image_part(&["data:", media_type, ";base64,", data]), true)
}

/// An image source's string field's escaped text, `default` when absent.
fn source_text<'a>(
    raw: Option<&'a RawValue>,
    default: &'static str,
    what: &str,
) -> Result<&'a str, InvalidParam> {
    match raw {
        None => Ok(default),
        Some(r) => string_body(r).ok_or_else(|| {
            InvalidParam::new(
                "messages",
                format!("an image source's `{what}` must be a string"),
            )
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn parts(items: &[Item]) -> Vec<Value> {
        items
            .iter()
            .map(|i| serde_json::from_slice(&i.part).unwrap())
            .collect()
    }

    #[test]
    fn responses_images_and_audio_become_chat_parts_without_a_uuid() {
        let input = json!([
            {"role": "system", "content": "be brief"},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "look"},
                {"type": "input_image", "image_url": "data:image/png;base64,AB", "detail": "auto", "uuid": "mine"},
                {"type": "input_image", "file_id": "f1"},
                {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}},
            ]},
            {"role": "assistant", "content": [{"type": "input_image", "image_url": "u"}]},
            {"type": "function_call_output", "call_id": "c", "output": "o"},
        ]);
        let items = responses(input.to_string().as_bytes(), 8).unwrap();
        assert_eq!(
            parts(&items),
            [
                json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AB"}}),
                json!({"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}),
            ]
        );
        assert!(items[0].batched && !items[1].batched);
        assert!(responses(br#""just text""#, 8).unwrap().is_empty());
        // The client's escapes are kept: the string still decodes to the same URL.
        let escaped = br#"[{"role":"user","content":[{"type":"input_image","image_url":"a\/b"}]}]"#;
        let part: Value = serde_json::from_slice(&responses(escaped, 8).unwrap()[0].part).unwrap();
        assert_eq!(part["image_url"]["url"], "a/b");
        assert!(responses(input.to_string().as_bytes(), 1).is_err());
    }

    #[test]
    fn messages_images_become_the_urls_vllm_builds() {
        let body = json!([
            {"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}},
                {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                {"type": "image", "source": {"data": "REVG"}},
                {"type": "tool_result", "tool_use_id": "t", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/gif", "data": "R0"}},
                ]},
            ]},
            {"role": "assistant", "content": [{"type": "tool_result", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://not/an/item"}},
            ]}]},
        ]);
        let items = messages(body.to_string().as_bytes(), 8).unwrap();
        let urls: Vec<Value> = parts(&items)
            .into_iter()
            .map(|p| p["image_url"]["url"].clone())
            .collect();
        assert_eq!(
            urls,
            [
                "data:image/png;base64,QUJD",
                "https://x/y.png",
                "data:image/jpeg;base64,REVG",
                "data:image/gif;base64,R0",
            ]
        );
        let bad = json!([{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": 3, "data": "x"}}]}]);
        assert!(messages(bad.to_string().as_bytes(), 8).is_err());
    }

    #[test]
    fn contents_that_are_no_lists_hold_no_items_and_the_ceiling_holds() {
        let input = br#"[{"role":"user","content":"input_image"},
            {"role":"user","content":{"type":"input_image","image_url":"x"}}, 3,
            {"role":"user","content":[7, {"type":"input_image","image_url":"a"},
                                      {"type":"input_image","image_url":"b"}]}]"#;
        assert_eq!(responses(input, 2).unwrap().len(), 2);
        assert!(responses(input, 1).is_err());
        assert!(responses(b"{}", 1).unwrap().is_empty());
        assert!(responses(b"[\"\xff\"]", 1).unwrap().is_empty());
        let blocks = br#"[{"role":"user","content":[
            {"type":"tool_result","content":"text"},
            {"type":"tool_result","content":[{"type":"image","source":{"type":"url","url":"a"}},
                                             {"type":"image","source":{"type":"url","url":"b"}}]}]}]"#;
        assert_eq!(messages(blocks, 2).unwrap().len(), 2);
        assert!(messages(blocks, 1).is_err());
        assert!(messages(b"null", 1).unwrap().is_empty());
    }
}
